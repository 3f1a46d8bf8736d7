"""What changed in the read models, as it commits: the followers NOTIFY in the transaction that wrote the rows
(adapters/projection.py), one connection here LISTENs and hands each notice to every subscriber (the console's
server-sent event streams). A console action announces itself the same way, so every open page sees it."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager

import asyncpg

from gpuaas_common.logging import get_logger

from .projection import CHANGED_CHANNEL

log = get_logger(__name__)

# A subscriber that does not keep up loses notices, not memory: one it has not read yet already says "refresh".
QUEUE_SIZE = 16
BACKOFF_S = (0.5, 1.0, 2.0, 5.0)


class Changes:
    def __init__(self, pool: asyncpg.Pool) -> None:
        self.pool = pool
        self._subscribers: set[asyncio.Queue[str]] = set()
        self.listening = asyncio.Event()

    @contextmanager
    def subscribe(self) -> Iterator[asyncio.Queue[str]]:
        queue: asyncio.Queue[str] = asyncio.Queue(QUEUE_SIZE)
        self._subscribers.add(queue)
        try:
            yield queue
        finally:
            self._subscribers.discard(queue)

    def announce(self, what: str) -> None:
        for queue in list(self._subscribers):
            if not queue.full():
                queue.put_nowait(what)

    def _notified(self, _conn: object, _pid: int, _channel: str, payload: str) -> None:
        self.announce(payload)

    async def run(self) -> None:
        """Listen for good: after a lost connection, listen again and tell every subscriber to refresh (what
        committed while nobody listened is not lost, only its notice)."""
        failures = 0
        while True:
            lost = asyncio.Event()

            def terminated(_conn: object, lost: asyncio.Event = lost) -> None:
                lost.set()

            try:
                async with self.pool.acquire() as conn:
                    conn.add_termination_listener(terminated)
                    await conn.add_listener(CHANGED_CHANNEL, self._notified)
                    self.listening.set()
                    if failures:
                        self.announce("reconnected")
                    failures = 0
                    try:
                        await lost.wait()
                    finally:
                        self.listening.clear()
                        conn.remove_termination_listener(terminated)
                        if not conn.is_closed():
                            await conn.remove_listener(CHANGED_CHANNEL, self._notified)
            except asyncio.CancelledError:
                raise
            except (asyncpg.PostgresError, OSError, asyncpg.InterfaceError) as exc:
                log.warning("changes_listen_failed", error=repr(exc))
            delay = BACKOFF_S[min(failures, len(BACKOFF_S) - 1)]
            failures += 1
            await asyncio.sleep(delay)  # back-off before listening again, not a wait for something
