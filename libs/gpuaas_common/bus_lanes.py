"""Order per aggregate inside one consumer, and keeping a message alive while it waits or runs.

Part of the bus (`gpuaas_common.bus` re-exports the public names): a durable with several places in flight
gives each message a lane by its `ordering_key`; messages of one lane run one after the other, in delivery
order, and every message in hand sends progress acks until it is done.
"""

from __future__ import annotations

import asyncio
from typing import Any

from .bus_parsing import decode_body
from .logging import get_logger

# The bus's logger name, so its lines read as they did before the bus was split into modules.
log = get_logger("gpuaas_common.bus")

# Payload fields naming the aggregate a message belongs to, most specific first.
ORDERING_FIELDS = ("allocation_id", "operation_id", "slug", "node_id", "task_id")


def ordering_key(subject: str, body: bytes) -> str:
    """The aggregate a message belongs to; messages that share it are handled one after the other in delivery
    order. Unparseable bodies share one lane: they only go to the DLQ."""
    return lane_key(subject, decode_body(body))


def lane_key(subject: str, decoded: Any) -> str:
    """`ordering_key` of a body `decode_body` has decoded."""
    if not isinstance(decoded, dict):
        return "<unparseable>"
    payload = decoded.get("payload")
    if isinstance(payload, dict):
        for name in ORDERING_FIELDS:
            value = payload.get(name)
            if isinstance(value, (str, int)) and value != "":
                return f"{name}:{value}"
    return f"subject:{subject}"


class KeyedLanes:
    """Per-key FIFO without a task per key: each entrant gets the future of its predecessor (None when the
    lane is idle) and a `done` callback that releases its successor. Lanes vanish when they drain."""

    def __init__(self) -> None:
        self._tails: dict[str, asyncio.Future[None]] = {}

    def enter(self, key: str) -> tuple["asyncio.Future[None] | None", Any]:
        previous = self._tails.get(key)
        mine: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._tails[key] = mine

        def done() -> None:
            if not mine.done():
                mine.set_result(None)
            if self._tails.get(key) is mine:
                del self._tails[key]

        return previous, done

    def __len__(self) -> int:
        return len(self._tails)


class KeepAlive:
    """Progress acks (`+WPI`) every third of the ack wait until stopped, so JetStream redelivers a message
    only when its consumer is gone, not because its handler is slow. A timer, not a task: most messages
    finish long before the first progress ack is due and cost nothing."""

    def __init__(self, raw: Any, ack_wait_s: float) -> None:
        self._raw = raw
        self._interval = max(ack_wait_s / 3.0, 0.05)
        self._loop = asyncio.get_running_loop()
        self._handle: asyncio.TimerHandle | None = self._loop.call_later(self._interval, self._tick)
        self._sending: asyncio.Task[None] | None = None

    def _tick(self) -> None:
        if self._sending is None or self._sending.done():
            self._sending = self._loop.create_task(self._send())
        self._handle = self._loop.call_later(self._interval, self._tick)

    async def _send(self) -> None:
        try:
            await self._raw.in_progress()
        except Exception as exc:
            # A lost connection: the server redelivers after the ack wait, which is what it should do.
            log.debug("progress_ack_failed", error=repr(exc))

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
