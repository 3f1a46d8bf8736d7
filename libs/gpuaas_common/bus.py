"""Subscriber conventions shared by every service.

Every subscriber is a durable pull consumer provisioned by `jetstream.provision`, bound with
`declare=False`, and acknowledged manually: ack only after the handler's transaction committed,
nak with a growing delay on a transient error, and dead-letter (with the reason) a message that is
not JSON, breaks the contract, or has failed `max_deliver` times. A poison message therefore never
crashes a consumer and never blocks a stream.

Ack waits are short (a few seconds) so a message whose consumer died is redelivered soon; a message
still being worked on (or waiting for a free place) is kept by progress acks every third of the ack wait.

Order per aggregate, and replicas. Within one process a durable's messages with one ordering key
(`ordering_key`: allocation, task, operation, node, image) run one after the other, in delivery order.
Replicas of a service share each durable, so two messages about one aggregate can be handled by two
replicas at the same time, and the later one may commit first. Nothing in the bus prevents that; every
handler keeps its aggregate consistent itself, by this rule:
1. Serialise: a handler's first statement locks its aggregate's row (`SELECT … FOR UPDATE`; where the
   service keeps no such row yet, a transaction-scoped advisory lock on the aggregate id), so handlers
   of one aggregate run one at a time across replicas, as they do in one lane.
2. Check the transition: the aggregate accepts a message only from the states it may follow. A message
   that overtook its predecessor (the predecessor is still being handled elsewhere, or being retried)
   raises a transient error: nothing is written, the message is nak'ed and redelivered after a delay,
   and one whose predecessor never comes ends in the DLQ with that reason. It is never applied out of
   order, and never acknowledged as done while its effect is missing.
3. A message that is stale (its effect is already superseded, e.g. an older report, a repeat) is
   recorded as such and acknowledged; that is a decision of the aggregate, not an accident of timing.
Pollers and sweeps follow the same idea with row claims: leases or `FOR UPDATE SKIP LOCKED`, never a
read followed by an unconditional write; the outbox relay holds a per-schema advisory lock.
"""

from __future__ import annotations

import asyncio
import base64
import functools
import json
import re
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import asyncpg
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from prometheus_client import Counter
from pydantic import BaseModel, ValidationError

from .contract import BY_TYPE, Envelope, derived_event_id, spec_for
from .contract.messages import DeadLetter
from .jetstream import PUBACK_TIMEOUT_S, ConsumerSpec
from .logging import bound_context, get_logger
from .pull import PULL_EXPIRES_S, PullLoop
from .unit_of_work import EventCollector, UnitOfWork, no_repositories

log = get_logger(__name__)

HANDLED = Counter("gpuaas_messages_total", "Messages handled", ["consumer", "outcome"])

# JetStream API calls at start (each durable's lookup) wait up to 15 s instead of nats-py's 5 s: on a 3-server
# cluster still settling its leaders on a loaded machine one took longer, and a service exits at start on that
# (nats_setup_failed; seen starting the chaos stack).
START_API_TIMEOUT_S = 15.0


def _pull_loop_ended(task: "asyncio.Task[None]") -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("pull_loop_died", task=task.get_name(), error=repr(task.exception()))


class PermanentError(Exception):
    """The message can never succeed: dead-letter it at once instead of retrying."""

    def __init__(self, reason_code: str, reason: str) -> None:
        super().__init__(reason)
        self.reason_code = reason_code
        self.reason = reason


@dataclass
class HandlerContext:
    """One message as a handler sees it; `uow` is the unit of work it runs in (transactional consumers)."""

    envelope: Envelope
    payload: Any
    subject: str
    consumer: str
    num_delivered: int
    uow: Any = None  # UnitOfWork | FakeUnitOfWork

    @property
    def conn(self) -> asyncpg.Connection:
        if self.uow is None:
            raise RuntimeError(f"{self.consumer} is not transactional: it has no database connection")
        return self.uow.conn

    @property
    def outbox(self) -> EventCollector:
        if self.uow is None:
            raise RuntimeError(f"{self.consumer} is not transactional: it has no outbox")
        return self.uow.events


async def deliver(handler: "Handler", ctx: HandlerContext, uow: Any, first_lock: str | None = None) -> bool:
    """Run one message's handler in its unit of work: inbox row, effects and events commit together.
    False when the consumer had already processed it (a redelivery or a republish): nothing happens.
    `first_lock`: the aggregate's advisory lock, taken with the BEGIN (`UnitOfWork.lock_first`)."""
    if first_lock is not None:
        uow.lock_first(first_lock)
    uow.expect_inbox(ctx.consumer, ctx.envelope.event_id)
    async with uow:
        if await uow.seen(ctx.consumer, ctx.envelope.event_id):
            return False
        ctx.uow = uow
        await handler(ctx)
        await uow.commit()
    return True


Handler = Callable[[HandlerContext], Awaitable[None]]


# `parse_message` without a decoded body decodes it itself.
_NOT_DECODED: Any = object()


def retry_delay(delays: tuple[float, ...], num_delivered: int) -> float:
    return delays[min(max(num_delivered - 1, 0), len(delays) - 1)]


def decode_body(body: bytes) -> Any:
    """The body as JSON, or the PermanentError saying why it is not. A consumer decodes each body once, at
    receipt: its lane key and its handler's payload both read the result."""
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        return PermanentError("not_json", f"body is not JSON: {exc}")
    # Valid JSON can still carry a NUL or a lone surrogate: Postgres stores neither (a text cannot hold NUL,
    # UTF-8 has no surrogates), so every attempt to record it would fail the same way until max_deliver. A NUL
    # can only come escaped (json.loads refuses raw control characters), a surrogate escaped or as the UTF-8
    # shape of one (json.loads decodes bytes with surrogatepass); a body holding neither shape, the common
    # one, costs two substring searches (0.2 us on a 0.5 kB body; the regex alone took 3.7 us) and no walk.
    if (
        (b"\\u" in body or b"\xed" in body)
        and _UNSTORABLE_SHAPE.search(body)
        and (where := _unstorable(data, "")) is not None
    ):
        return PermanentError("schema_invalid", f"{where} holds a NUL or a lone surrogate, which Postgres cannot store")
    return data


# `\u0000`, `\uD800`-`\uDFFF`, or the bytes ED A0-BF of an encoded surrogate. Escaped backslashes and paired
# surrogates match too: the walk settles them.
_UNSTORABLE_SHAPE = re.compile(rb"\\u(?:0000|[dD][89abcdefABCDEF])|\xed[\xa0-\xbf]")


def _unstorable(value: Any, where: str) -> str | None:
    """The path of the first string (or key) in `value` that Postgres cannot store, or None."""
    if isinstance(value, str):
        return (where or "<root>") if _UNSTORABLE_CHAR.search(value) else None
    if isinstance(value, dict):
        for key, item in value.items():
            found = _unstorable(key, f"{where}.<key>") or _unstorable(item, f"{where}.{key}")
            if found is not None:
                return found.lstrip(".")
    elif isinstance(value, list):
        for index, item in enumerate(value):
            found = _unstorable(item, f"{where}[{index}]")
            if found is not None:
                return found
    return None


# A pair of escaped surrogates decodes to one character outside the BMP; only unpaired ones remain here.
_UNSTORABLE_CHAR = re.compile("[\x00\ud800-\udfff]")


def parse_message(subject: str, body: bytes, decoded: Any = _NOT_DECODED) -> tuple[Envelope, BaseModel]:
    """Decode and validate a wire message (`decoded`: what `decode_body` made of `body` already); raises
    PermanentError with a reason code."""
    data = decode_body(body) if decoded is _NOT_DECODED else decoded
    if isinstance(data, PermanentError):
        raise data
    try:
        envelope = Envelope.model_validate(data)
    except ValidationError as exc:
        raise PermanentError("schema_invalid", f"envelope: {_errors(exc)}") from None
    spec = BY_TYPE.get(envelope.type)
    if spec is None:
        raise PermanentError("unknown_type", f"unknown message type {envelope.type!r}")
    if not spec.subject_regex().match(subject):
        raise PermanentError("schema_invalid", f"type {envelope.type} does not travel on {subject}")
    try:
        payload = spec.model.model_validate(envelope.payload)
    except ValidationError as exc:
        raise PermanentError("schema_invalid", f"{envelope.type} payload: {_errors(exc)}") from None
    _check_subject_names_payload(spec, subject, payload)
    return envelope, payload


def _check_subject_names_payload(spec: Any, subject: str, payload: BaseModel) -> None:
    """Defence in depth: the server lets a host publish only on its own subjects, so the subject is
    the authenticated part; a payload that names another node is forged or broken either way."""
    if "node_id" not in spec.parameters:
        return
    claimed = getattr(payload, "node_id", None)
    if claimed is None:
        return
    match = _node_subject(spec.address).fullmatch(subject)
    if match and match.group("node_id") != str(claimed):
        raise PermanentError(
            "subject_mismatch", f"{spec.type} on {subject} names node {claimed!r}, not {match.group('node_id')!r}"
        )


@functools.lru_cache(maxsize=None)
def _node_subject(address: str) -> re.Pattern[str]:
    """The address as a pattern that captures `{node_id}` (compiled once per message type: hot path)."""
    pattern = re.escape(address).replace(re.escape("{node_id}"), r"(?P<node_id>[A-Za-z0-9_-]+)")
    return re.compile(re.sub(r"\\\{[a-z_]+\\\}", "[A-Za-z0-9_-]+", pattern))


def _errors(exc: ValidationError) -> str:
    return "; ".join(f"{'.'.join(map(str, e['loc'])) or '<root>'}: {e['msg']}" for e in exc.errors()[:8])


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


class _KeepAlive:
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


class Bus:
    """Wires handlers to durable consumers and publishes directly (for services without an outbox).
    `start()` begins pulling every subscribed durable (`pull.PullLoop`), `stop()` ends it and lets the
    messages in hand finish."""

    def __init__(
        self,
        nc: NatsClient | None,
        js: JetStreamContext,
        *,
        service: str,
        schema: str | None,
        pool: asyncpg.Pool | None,
        retry_delays_s: tuple[float, ...] = (0.2, 0.5, 1.0, 2.0, 5.0),
        pull_expires_s: float = PULL_EXPIRES_S,
        default_concurrency: int = 1,
    ) -> None:
        # Pull replies arrive on `nc`'s inbox prefix: the identity's own, the only one its permissions allow.
        self.nc = nc
        self.js = js
        self.service = service
        self.schema = schema
        self.pool = pool
        self.retry_delays_s = retry_delays_s
        self.pull_expires_s = pull_expires_s
        self.consumers: list[ConsumerSpec] = []
        # What a service's unit of work builds on its connection; set by the service before it subscribes.
        self.repositories: Callable[[asyncpg.Connection], Any] = no_repositories
        self._in_flight: set[asyncio.Task[None]] = set()
        self._loops: list[PullLoop] = []
        self._running: list[asyncio.Task[None]] = []
        self.default_concurrency = default_concurrency

    def subscribe(
        self,
        spec: ConsumerSpec,
        handlers: Mapping[str, Handler],
        *,
        transactional: bool = True,
        concurrency: int | None = None,
        first_lock: Callable[[Any], str | None] | None = None,
    ) -> None:
        """`first_lock(payload)` names the advisory lock every handler of this consumer takes first (the
        aggregate's, where the service keeps no row to lock); it then travels with the BEGIN.

        `concurrency` > 1 keeps up to that many messages in flight at once, in order per aggregate
        (`ordering_key`: allocation, node, image, operation): one slow allocation holds up only itself. The
        pull loop asks for as many messages as there are free places; each message is handed to a task and
        acked by it after the handler."""
        if transactional and self.pool is None:
            raise ValueError("a transactional subscriber needs a database pool")
        if self.nc is None:
            raise ValueError("a bus without a connection only publishes")
        for type_ in handlers:
            spec_for(type_)  # fail at start-up on a typo, not at the first message
        self.consumers.append(spec)
        lanes = KeyedLanes()

        async def run(msg: Msg, decoded: Any, keep: _KeepAlive, turn: "asyncio.Future[None] | None", done: Any) -> None:
            try:
                if turn is not None:
                    await turn  # the previous message of the same aggregate has been handled
                await self.dispatch(spec, handlers, msg, transactional, first_lock, decoded)
            finally:
                done()

        def start(msg: Msg, free_place: Callable[[], None]) -> None:
            # From receipt: a message waiting for its turn is in flight too.
            keep = _KeepAlive(msg, spec.ack_wait_s)
            decoded = decode_body(msg.data)
            turn, lane_done = lanes.enter(lane_key(msg.subject, decoded))

            def done() -> None:
                lane_done()
                keep.stop()
                free_place()

            task = asyncio.create_task(run(msg, decoded, keep, turn, done))
            self._in_flight.add(task)
            task.add_done_callback(self._in_flight.discard)

        places = concurrency or self.default_concurrency
        self._loops.append(PullLoop(self.nc, spec, start, places, expires_s=self.pull_expires_s))

    async def start(
        self,
        on_loop_done: "Callable[[asyncio.Task[None]], None] | None" = None,
        *,
        check_durables: bool = True,
    ) -> None:
        """Check every durable is there (a missing one fails start-up, not the first pull), then pull.
        `check_durables=False` where the caller has just created or checked them (the runtime's
        `ensure_consumers`): on a 3-server cluster still electing the new consumers' leaders a second lookup
        may wait longer than any timeout we would want at start, while a pull simply waits for the leader.
        `on_loop_done(task)` learns of a pull loop that ended (the runtime's takes the service down: a dead
        loop is a consumer that silently stopped); by default it is logged."""
        for loop in self._loops if check_durables else ():
            await self.js.consumer_info(loop.spec.stream, loop.spec.durable, timeout=START_API_TIMEOUT_S)
        for loop in self._loops:
            task = asyncio.create_task(loop.run(), name=f"pull-{loop.spec.durable}")
            task.add_done_callback(on_loop_done or _pull_loop_ended)
            self._running.append(task)
            log.info("consumer_started", consumer=loop.spec.durable, places=loop.places)

    async def stop(self, grace_s: float = 10.0) -> None:
        """Stop pulling; the messages in hand get `grace_s` to finish (and be acked) before they are cancelled:
        JetStream redelivers whatever was not acked."""
        for task in self._running:
            task.cancel()
        await asyncio.gather(*self._running, return_exceptions=True)
        self._running.clear()
        if self._in_flight:
            _, pending = await asyncio.wait(set(self._in_flight), timeout=grace_s)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)

    async def dispatch(
        self,
        spec: ConsumerSpec,
        handlers: Mapping[str, Handler],
        msg: Msg,
        transactional: bool,
        first_lock: Callable[[Any], str | None] | None,
        decoded: Any,
    ) -> None:
        """One message, whose body `decode_body` decoded at receipt."""
        subject = msg.subject
        md = msg.metadata
        num_delivered = md.num_delivered or 1
        try:
            envelope, payload = parse_message(subject, msg.data, decoded)
        except PermanentError as exc:
            await self._dead_letter(spec, msg, exc.reason_code, exc.reason, num_delivered)
            await msg.ack()
            HANDLED.labels(spec.durable, exc.reason_code).inc()
            return
        handler = handlers.get(envelope.type)
        if handler is None:
            await msg.ack()
            HANDLED.labels(spec.durable, "ignored").inc()
            return
        ctx = HandlerContext(envelope, payload, subject, spec.durable, num_delivered)
        ids = {"event_id": envelope.event_id, "event_type": envelope.type, "correlation_id": envelope.correlation_id}
        for key in ("allocation_id", "task_id", "operation_id", "node_id"):
            value = getattr(payload, key, None)
            if value is not None:
                ids[key] = str(value)
        with bound_context(consumer=spec.durable, **ids):
            try:
                if transactional:
                    lock = first_lock(payload) if first_lock is not None else None
                    if await deliver(handler, ctx, self.unit_of_work(envelope), lock):
                        HANDLED.labels(spec.durable, "ok").inc()
                    else:
                        log.info("duplicate_ignored")
                        HANDLED.labels(spec.durable, "duplicate").inc()
                else:
                    await handler(ctx)
                    HANDLED.labels(spec.durable, "ok").inc()
            except PermanentError as exc:
                log.warning("message_rejected", reason_code=exc.reason_code, reason=exc.reason)
                await self._dead_letter(spec, msg, exc.reason_code, exc.reason, num_delivered)
                await msg.ack()
                HANDLED.labels(spec.durable, "dead_lettered").inc()
                return
            except Exception as exc:
                if num_delivered >= spec.max_deliver:
                    log.error("message_gave_up", error=repr(exc), num_delivered=num_delivered, exc_info=True)
                    await self._dead_letter(spec, msg, "max_deliver", repr(exc), num_delivered)
                    await msg.term()
                    HANDLED.labels(spec.durable, "dead_lettered").inc()
                else:
                    delay = retry_delay(self.retry_delays_s, num_delivered)
                    log.warning("message_retry", error=repr(exc), num_delivered=num_delivered, delay_s=delay)
                    await msg.nak(delay=delay)
                    HANDLED.labels(spec.durable, "retried").inc()
                return
            await msg.ack()

    def unit_of_work(self, envelope: Envelope | None = None) -> UnitOfWork[Any]:
        """A unit of work in this service's schema, its events caused by `envelope` (if any)."""
        if self.pool is None or self.schema is None:
            raise ValueError(f"{self.service} has no database: no unit of work")
        return UnitOfWork(
            self.pool,
            self.schema,
            self.service,
            self.repositories,
            correlation_id=envelope.correlation_id if envelope else None,
            causation_id=envelope.event_id if envelope else None,
        )

    async def _dead_letter(self, spec: ConsumerSpec, raw: Any, reason_code: str, reason: str, num: int) -> None:
        md = raw.metadata
        stream_seq = md.sequence.stream if md and md.sequence else None
        try:
            body_text: str | None = raw.data.decode("utf-8")
            body_b64 = None
        except UnicodeDecodeError:
            body_text, body_b64 = None, base64.b64encode(raw.data).decode()
        letter = DeadLetter(
            consumer=spec.durable,
            stream=spec.stream,
            subject=raw.subject,
            stream_seq=stream_seq,
            num_delivered=num,
            reason_code=reason_code,  # type: ignore[arg-type]
            reason=reason[:8000],
            headers={k: str(v) for k, v in (raw.headers or {}).items()},
            body_text=body_text[:100_000] if body_text is not None else None,
            body_base64=body_b64,
        )
        cause = f"{spec.stream}:{stream_seq}" if stream_seq is not None else raw.subject
        await self.publish(
            "dead_letter",
            letter,
            correlation_id=cause,
            event_id=derived_event_id(cause, f"dlq:{spec.durable}"),
            consumer=spec.durable,
        )
        log.warning("dead_lettered", reason_code=reason_code, reason=reason[:500], stream_seq=stream_seq)

    async def publish(
        self,
        type_: str,
        payload: BaseModel,
        *,
        correlation_id: str,
        causation_id: str | None = None,
        event_id: str | None = None,
        timeout: float = PUBACK_TIMEOUT_S,
        **subject_params: str,
    ) -> Envelope:
        """Publish without an outbox (node agents, dead letters) and insist on a PubAck within `timeout`."""
        spec = spec_for(type_)
        envelope = Envelope.wrap(
            type_,
            payload.model_dump(mode="json"),
            producer=self.service,
            correlation_id=correlation_id,
            causation_id=causation_id,
            event_id=event_id,
        )
        ack = await self.js.publish(
            spec.subject(**subject_params),
            envelope.model_dump_json().encode(),
            headers={"Nats-Msg-Id": envelope.event_id},
            timeout=timeout,
        )
        if not ack.stream:
            raise RuntimeError(f"no PubAck stream for {type_}")
        return envelope
