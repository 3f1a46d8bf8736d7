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
from dataclasses import dataclass

import nats.errors
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.js.client import JetStreamContext

from .bus_gate import TrafficGate
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
        gate: TrafficGate | None = None,
    ) -> None:
        self.nc = nc
        # An open request counts as traffic in flight: a credential switch waits until it is filled or expired.
        self.gate = gate or TrafficGate()
        self.spec = spec
        self.next_subject = f"$JS.API.CONSUMER.MSG.NEXT.{spec.stream}.{spec.durable}"
        self._start = start
        self.places = places
        self.expires_s = expires_s
        self.requests = 0
        self._busy = 0
        self._freed = asyncio.Event()
        self._open: _Request | None = None
        self.reply_prefix = ""

    def _done(self) -> None:
        self._busy -= 1
        self._freed.set()

    async def run(self) -> None:
        # Each request has its own reply subject under one wildcard subscription: the server answers the end
        # of a request (408 expired, 409 refused) on that request's subject, so a late answer to an earlier
        # request is told apart from the open one's and cannot end it (the open one would stay on the server
        # while another is sent, and both could deliver: more messages than places).
        # A callback subscription, not `next_msg`: nats-py's next_msg makes a task, a wait_for (another task
        # on Python 3.11) and a uuid4 for every message; the callback is one call on the subscription's task,
        # and a request's expiry is one timer per request.
        self.reply_prefix = self.nc.new_inbox()
        sub = await self.nc.subscribe(f"{self.reply_prefix}.*", cb=self._on_message)
        loop = asyncio.get_running_loop()
        refusals = 0
        try:
            while True:
                while self._busy >= self.places:
                    self._freed.clear()
                    await self._freed.wait()
                if not self.gate.is_open:
                    await self.gate.wait_open()  # a credential switch: no new request until it is done
                    continue
                if not self.nc.is_connected:
                    # Reconnecting: a request now would wait in nats-py's buffer and reach the server with
                    # every other one sent meanwhile, each asking for the same free places.
                    if self.nc.is_closed:
                        return
                    await asyncio.sleep(RECONNECT_POLL_S)
                    continue
                want = self.places - self._busy
                request = _Request(f"{self.reply_prefix}.{self.requests + 1}", want, loop.create_future())
                self._open = request
                self.gate.enter()  # checked open above, nothing awaited since
                try:
                    outcome = await self._ask(request, loop)
                finally:
                    self.gate.leave()
                    self._open = None
                if outcome == "closed":
                    return
                if outcome == "failed":
                    await asyncio.sleep(REFUSED_BACKOFF_S[-1])
                    continue
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

    async def _ask(self, request: "_Request", loop: asyncio.AbstractEventLoop) -> str:
        """Send one request and wait for its end: filled, expired, refused; or closed / failed (not sent)."""
        try:
            await self.nc.publish(
                self.next_subject,
                json.dumps({"batch": request.want, "expires": int(self.expires_s * 1e9)}).encode(),
                reply=request.reply,
            )
        except nats.errors.ConnectionClosedError:
            return "closed"
        except nats.errors.Error as exc:  # reconnecting with a full buffer: try again shortly
            log.warning("pull_request_failed", consumer=self.spec.durable, error=repr(exc))
            return "failed"
        self.requests += 1
        # Quietly expired: the server that held the request is gone, or slow to say so.
        timer = loop.call_later(self.expires_s + GRACE_S, request.end, "expired")
        try:
            return await request.ended
        finally:
            timer.cancel()

    async def _on_message(self, msg: Msg) -> None:
        """What the server sends on the reply subjects: stream messages (they carry their stream subject) and
        the status answers that end a request (on that request's own subject)."""
        status = JetStreamContext.is_status_msg(msg)
        request = self._open
        if status is None:
            # Counted against the open request; one that came after its request ended is still a message to
            # handle (and acknowledge), never dropped.
            self._busy += 1
            self._start(msg, self._done)
            if request is not None:
                request.got += 1
                if request.got >= request.want:
                    request.end("filled")
            return
        if request is None or msg.subject != request.reply or status == "100":
            return  # the late end of an earlier request, which no longer counts, or an idle heartbeat
        if status in ("404", "408"):
            request.end("expired")
            return
        # 409 and the rest: consumer deleted, leader changed, too many waiting requests.
        description = (msg.headers or {}).get("Description", "")
        log.info("pull_refused", consumer=self.spec.durable, status=status, description=description)
        request.end("refused")


@dataclass
class _Request:
    """One open pull request: answered on `reply`, for `want` messages; `ended` resolves to 'filled',
    'expired' (or lost) or 'refused'."""

    reply: str
    want: int
    ended: "asyncio.Future[str]"
    got: int = 0

    def end(self, outcome: str) -> None:
        if not self.ended.done():
            self.ended.set_result(outcome)
