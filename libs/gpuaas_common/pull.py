"""A durable's messages pulled in batches that never linger.

One pull request stays open for as many messages as the consumer has free places; the server delivers each
message as soon as it is there, so a message at low load waits for nothing, and under load one request brings
a batch. A new request goes out when the open one is filled, expired (`expires_s`, the longest a request that
the server lost — a dead server, a leader change — goes unnoticed) or refused.

Why not the libraries' loops: FastStream's pull subscriber sends one request per message (`batch_size=1`; a
larger batch runs its messages concurrently, out of order), and nats-py's `fetch(batch=N)` returns only once N
messages came or the request expired, which adds up to the expiry to every message at low load.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import nats.errors
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.js.client import JetStreamContext

from .jetstream import ConsumerSpec
from .logging import get_logger

log = get_logger(__name__)

# A request the server lost is noticed after this long (plus GRACE_S): a lost one is asked again, at the cost
# of one request per second per idle consumer (what FastStream's loop spent too).
PULL_EXPIRES_S = 1.0
GRACE_S = 0.25
# How often a loop looks whether its connection is back, while nats-py reconnects.
RECONNECT_POLL_S = 0.1
# After a refusal (409: consumer deleted, too many waiting requests, leader change), before asking again.
REFUSED_BACKOFF_S = (0.05, 0.2, 1.0)


class PullLoop:
    """Pulls one durable's messages and starts `start(msg, done)` for each; `done()` frees its place.
    At most `places` messages are started and not done (a request never asks for more than are free)."""

    def __init__(
        self,
        nc: NatsClient,
        spec: ConsumerSpec,
        start: Callable[[Msg, Callable[[], None]], None],
        places: int,
        *,
        expires_s: float = PULL_EXPIRES_S,
    ) -> None:
        self.nc = nc
        self.spec = spec
        self.next_subject = f"$JS.API.CONSUMER.MSG.NEXT.{spec.stream}.{spec.durable}"
        self._start = start
        self.places = places
        self.expires_s = expires_s
        self.requests = 0
        self._busy = 0
        self._freed = asyncio.Event()
        self.reply_prefix = ""

    def _done(self) -> None:
        self._busy -= 1
        self._freed.set()

    async def run(self) -> None:
        # Each request has its own reply subject under one wildcard subscription: the server answers the end
        # of a request (408 expired, 409 refused) on that request's subject, so a late answer to an earlier
        # request is told apart from the open one's and cannot end it (the open one would stay on the server
        # while another is sent, and both could deliver: more messages than places).
        self.reply_prefix = self.nc.new_inbox()
        sub = await self.nc.subscribe(f"{self.reply_prefix}.*")
        refusals = 0
        try:
            while True:
                while self._busy >= self.places:
                    self._freed.clear()
                    await self._freed.wait()
                if not self.nc.is_connected:
                    # Reconnecting: a request now would wait in nats-py's buffer and reach the server with
                    # every other one sent meanwhile, each asking for the same free places.
                    if self.nc.is_closed:
                        return
                    await asyncio.sleep(RECONNECT_POLL_S)
                    continue
                want = self.places - self._busy
                reply = f"{self.reply_prefix}.{self.requests + 1}"
                try:
                    await self.nc.publish(
                        self.next_subject,
                        json.dumps({"batch": want, "expires": int(self.expires_s * 1e9)}).encode(),
                        reply=reply,
                    )
                except nats.errors.ConnectionClosedError:
                    return
                except nats.errors.Error as exc:  # reconnecting with a full buffer: try again shortly
                    log.warning("pull_request_failed", consumer=self.spec.durable, error=repr(exc))
                    await asyncio.sleep(REFUSED_BACKOFF_S[-1])
                    continue
                self.requests += 1
                outcome = await self._receive(sub, want, reply)
                if outcome == "refused":
                    await asyncio.sleep(REFUSED_BACKOFF_S[min(refusals, len(REFUSED_BACKOFF_S) - 1)])
                    refusals += 1
                else:
                    refusals = 0
        finally:
            try:
                await sub.unsubscribe()
            except nats.errors.Error:
                pass  # the connection is gone: so is the subscription

    async def _receive(self, sub: Any, want: int, reply: str) -> str:
        """Start what the open request (answered on `reply`) brings: 'filled', 'expired' (or lost) or
        'refused'. Messages carry their stream subject; only the server's status answers come on `reply`."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.expires_s + GRACE_S
        got = 0
        while got < want:
            try:
                msg = await sub.next_msg(timeout=max(deadline - loop.time(), 0.001))
            except nats.errors.TimeoutError:
                return "expired"  # quietly: the server that held the request is gone, or slow to say so
            status = JetStreamContext.is_status_msg(msg)
            if status is not None and msg.subject != reply:
                continue  # the late end of an earlier request, which no longer counts
            if status is None:
                got += 1
                self._busy += 1
                self._start(msg, self._done)
            elif status == "100":
                continue  # an idle heartbeat
            elif status in ("404", "408"):
                return "expired"
            else:
                # 409 and the rest: consumer deleted, leader changed, too many waiting requests.
                description = (msg.headers or {}).get("Description", "")
                log.info("pull_refused", consumer=self.spec.durable, status=status, description=description)
                return "refused"
        return "filled"
