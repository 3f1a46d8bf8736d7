"""What the bus does with one message once its turn has come: parse it, run its handler (in a unit of work
for a transactional consumer), then ack it, nak it for a retry, or dead-letter it with the reason.

Part of the bus (`gpuaas_common.bus` re-exports the public names; `Bus.dispatch` runs `dispatch`).
"""

from __future__ import annotations

import base64
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, Protocol

import asyncpg
from nats.aio.msg import Msg
from prometheus_client import Counter
from pydantic import BaseModel
from typing_extensions import TypeVar

from .bus_parsing import PermanentError, parse_message
from .contract import Envelope, derived_event_id
from .contract.messages import DeadLetter
from .inbox import HostInbox
from .jetstream import ConsumerSpec
from .logging import bound_context, get_logger
from .outbox import EventCollector
from .unit_of_work import UnitOfWork

# The bus's logger name, so its lines read as they did before the bus was split into modules.
log = get_logger("gpuaas_common.bus")

HANDLED = Counter("gpuaas_messages_total", "Messages handled", ["consumer", "outcome"])


class HandlerWork(Protocol):
    """What the context needs of any unit of work a handler runs in: its outbox."""

    @property
    def events(self) -> EventCollector: ...


# A handler names its message's payload and its service's unit of work (a port, service_layer/ports.py) as
# `HandlerContext[Payload, UnitOfWorkPort]`, so a type checker follows its repository calls; a bare
# `HandlerContext` is `HandlerContext[Any, Any]`, as every context was before.
P = TypeVar("P", default=Any)
U = TypeVar("U", bound=HandlerWork, default=Any)


@dataclass
class HandlerContext(Generic[P, U]):
    """One message as a handler sees it; `uow` is the unit of work it runs in (transactional consumers; `deliver`
    sets it, so a handler of such a consumer never sees it None). `stream_seq`: the message's place in its
    stream, by which another process can read the same message back (the credential authority reads a deploy
    command the gateway names); None where no stream delivered it."""

    envelope: Envelope
    payload: P
    subject: str
    consumer: str
    num_delivered: int
    uow: U = None  # type: ignore[assignment]  # UnitOfWork | FakeUnitOfWork, once `deliver` opened it
    stream_seq: int | None = None

    @property
    def conn(self) -> asyncpg.Connection:
        if self.uow is None:
            raise RuntimeError(f"{self.consumer} is not transactional: it has no database connection")
        # Not every unit of work has a connection (a fake's raises): asked for untyped, as before.
        work: Any = self.uow
        conn: asyncpg.Connection = work.conn
        return conn

    @property
    def outbox(self) -> EventCollector:
        if self.uow is None:
            raise RuntimeError(f"{self.consumer} is not transactional: it has no outbox")
        return self.uow.events


async def deliver(
    handler: "Handler", ctx: HandlerContext, uow: Any, first_lock: str | None = None, host: HostInbox | None = None
) -> bool:
    """Run one message's handler in its unit of work: inbox row, effects and events commit together.
    False when the consumer had already processed it (a redelivery or a republish): nothing happens.
    `first_lock`: the aggregate's advisory lock, taken with the BEGIN (`UnitOfWork.lock_first`). `host`: a
    host-fed consumer's message, whose inbox row joins its node's capped group (`inbox.HostInbox`)."""
    if first_lock is not None:
        uow.lock_first(first_lock)
    uow.expect_inbox(ctx.consumer, ctx.envelope.event_id, host)
    async with uow:
        if await uow.seen(ctx.consumer, ctx.envelope.event_id):
            return False
        ctx.uow = uow
        await handler(ctx)
        await uow.commit()
    return True


Handler = Callable[[HandlerContext], Awaitable[None]]
FirstLock = Callable[[Any], str | None]
# Whether a parsed payload is the consumer's business at all (bus.subscribe's `wanted`).
Wanted = Callable[[Any], bool]
# Why a message (its subject, its decoded body) is refused before it is parsed, or None (bus.subscribe's `refuse`).
Refuse = Callable[[str, Any], str | None]


def retry_delay(delays: tuple[float, ...], num_delivered: int) -> float:
    return delays[min(max(num_delivered - 1, 0), len(delays) - 1)]


class HeldDeadLetters:
    """A host's dead letters, kept at home: hosts are off the DLQ path (issue 38), so a message its agent cannot
    handle is logged there (its reason, never its body: tasks carry tenants' keys) and counted; the agent reports
    the count (`node.drift_reported`'s `dead_lettered`), and nothing of the body crosses the bus."""

    def __init__(self) -> None:
        self.count = 0
        self.by_reason: dict[str, int] = {}

    def hold(self, consumer: str, subject: str, reason_code: str, reason: str, stream_seq: int | None) -> None:
        self.count += 1
        self.by_reason[reason_code] = self.by_reason.get(reason_code, 0) + 1
        log.warning(
            "dead_letter_held",
            consumer=consumer,
            subject=subject,
            reason_code=reason_code,
            reason=reason[:500],
            stream_seq=stream_seq,
            held=self.count,
        )


class DispatchingBus(Protocol):
    """The bus as dispatch uses it. Read at each message, not copied: a service sets its repositories on the
    bus after building it. `held_dead_letters`: where set (a host's bus), dead letters stay local and counted."""

    retry_delays_s: tuple[float, ...]
    held_dead_letters: HeldDeadLetters | None

    def unit_of_work(self, envelope: Envelope | None = None) -> UnitOfWork[Any]: ...

    async def publish(
        self,
        type_: str,
        payload: BaseModel,
        *,
        correlation_id: str,
        causation_id: str | None = None,
        event_id: str | None = None,
        timeout: float = ...,
        **subject_params: str,
    ) -> Envelope: ...


async def dispatch(
    bus: DispatchingBus,
    spec: ConsumerSpec,
    handlers: Mapping[str, Handler],
    msg: Msg,
    transactional: bool,
    first_lock: FirstLock | None,
    decoded: Any,
    wanted: Wanted | None = None,
    refuse: Refuse | None = None,
    host: HostInbox | None = None,
) -> None:
    """One message, whose body `decode_body` decoded at receipt; `host`: where a host-fed one's inbox row goes."""
    num_delivered = msg.metadata.num_delivered or 1
    if refuse is not None and (why := refuse(msg.subject, decoded)) is not None:
        await _refuse(spec, msg, why)
        return
    try:
        envelope, payload = parse_message(msg.subject, msg.data, decoded)
    except PermanentError as exc:
        await dead_letter(bus, spec, msg, exc.reason_code, exc.reason, num_delivered)
        await msg.ack()
        HANDLED.labels(spec.durable, exc.reason_code).inc()
        return
    handler = handlers.get(envelope.type)
    if handler is None or (wanted is not None and not wanted(payload)):
        await msg.ack()
        HANDLED.labels(spec.durable, "ignored").inc()
        return
    md = msg.metadata
    stream_seq = md.sequence.stream if md and md.sequence else None
    ctx = HandlerContext(envelope, payload, msg.subject, spec.durable, num_delivered, stream_seq=stream_seq)
    with bound_context(consumer=spec.durable, **_log_ids(envelope, payload)):
        try:
            await _handle(bus, handler, ctx, transactional, first_lock, host)
        except PermanentError as exc:
            await _reject(bus, spec, msg, exc, num_delivered)
            return
        except Exception as exc:
            await _retry_or_give_up(bus, spec, msg, exc, num_delivered)
            return
        await msg.ack()


def _log_ids(envelope: Envelope, payload: Any) -> dict[str, Any]:
    """What every log line about this message carries: its ids and the aggregates it names."""
    ids = {"event_id": envelope.event_id, "event_type": envelope.type, "correlation_id": envelope.correlation_id}
    for key in ("allocation_id", "task_id", "operation_id", "node_id"):
        value = getattr(payload, key, None)
        if value is not None:
            ids[key] = str(value)
    return ids


async def _handle(
    bus: DispatchingBus,
    handler: Handler,
    ctx: HandlerContext,
    transactional: bool,
    first_lock: FirstLock | None,
    host: HostInbox | None,
) -> None:
    if not transactional:
        await handler(ctx)
        HANDLED.labels(ctx.consumer, "ok").inc()
        return
    lock = first_lock(ctx.payload) if first_lock is not None else None
    if await deliver(handler, ctx, bus.unit_of_work(ctx.envelope), lock, host):
        HANDLED.labels(ctx.consumer, "ok").inc()
    else:
        log.info("duplicate_ignored")
        HANDLED.labels(ctx.consumer, "duplicate").inc()


async def _refuse(spec: ConsumerSpec, msg: Msg, why: str) -> None:
    """Refused unread: terminated (never redelivered), logged and counted, and not dead-lettered, since a letter
    would store the refused body in the DLQ under this consumer's name for whoever sent it."""
    md = msg.metadata
    stream_seq = md.sequence.stream if md and md.sequence else None
    log.warning("message_refused", consumer=spec.durable, subject=msg.subject, stream_seq=stream_seq, reason=why[:500])
    await msg.term()
    HANDLED.labels(spec.durable, "refused").inc()


async def _reject(bus: DispatchingBus, spec: ConsumerSpec, msg: Msg, exc: PermanentError, num_delivered: int) -> None:
    """The handler said the message can never succeed."""
    log.warning("message_rejected", reason_code=exc.reason_code, reason=exc.reason)
    await dead_letter(bus, spec, msg, exc.reason_code, exc.reason, num_delivered)
    await msg.ack()
    HANDLED.labels(spec.durable, "dead_lettered").inc()


async def _retry_or_give_up(
    bus: DispatchingBus, spec: ConsumerSpec, msg: Msg, exc: Exception, num_delivered: int
) -> None:
    """A transient failure: nak with a growing delay, or dead-letter once `max_deliver` is spent. Called while
    `exc` is being handled, so the log line's `exc_info` finds its traceback."""
    if num_delivered >= spec.max_deliver:
        log.error("message_gave_up", error=repr(exc), num_delivered=num_delivered, exc_info=True)
        await dead_letter(bus, spec, msg, "max_deliver", repr(exc), num_delivered)
        await msg.term()
        HANDLED.labels(spec.durable, "dead_lettered").inc()
    else:
        delay = retry_delay(bus.retry_delays_s, num_delivered)
        log.warning("message_retry", error=repr(exc), num_delivered=num_delivered, delay_s=delay)
        await msg.nak(delay=delay)
        HANDLED.labels(spec.durable, "retried").inc()


async def dead_letter(
    bus: DispatchingBus, spec: ConsumerSpec, raw: Any, reason_code: str, reason: str, num: int
) -> None:
    """Publish `raw` to the DLQ with the reason. Its event id comes from the message's place in the stream:
    dead-lettering the same message again within JetStream's duplicate window publishes nothing new."""
    md = raw.metadata
    stream_seq = md.sequence.stream if md and md.sequence else None
    held = getattr(bus, "held_dead_letters", None)
    if held is not None:
        held.hold(spec.durable, raw.subject, reason_code, reason, stream_seq)
        return
    letter = _fitting_letter(spec, raw, reason_code, reason, num, stream_seq)
    cause = f"{spec.stream}:{stream_seq}" if stream_seq is not None else raw.subject
    await bus.publish(
        "dead_letter",
        letter,
        correlation_id=cause,
        event_id=derived_event_id(cause, f"dlq:{spec.durable}"),
        consumer=spec.durable,
    )
    log.warning("dead_lettered", reason_code=reason_code, reason=reason[:500], stream_seq=stream_seq)


# A dead letter must fit what its publisher may send: a host's user may publish 64 KiB (the flood limits), and a
# letter over it makes the server drop the host's connection, not just the letter. The body is kept whole when
# it fits, else cut until the whole envelope does (JSON escaping can make text several times longer).
LETTER_BUDGET = 48 * 1024
BODY_CAP = 100_000


def _fitting_letter(
    spec: ConsumerSpec, raw: Any, reason_code: str, reason: str, num: int, stream_seq: int | None
) -> DeadLetter:
    cap = BODY_CAP
    while True:
        data = raw.data[:cap]
        try:
            body_text: str | None = data.decode("utf-8")
            body_b64 = None
        except UnicodeDecodeError:
            body_text, body_b64 = None, base64.b64encode(data).decode()
        cut = len(raw.data) > cap
        letter = DeadLetter(
            consumer=spec.durable,
            stream=spec.stream,
            subject=raw.subject,
            stream_seq=stream_seq,
            num_delivered=num,
            reason_code=reason_code,  # type: ignore[arg-type]
            reason=(reason[:8000] + (f" (body cut to its first {cap} of {len(raw.data)} bytes)" if cut else "")),
            headers={k: str(v)[:1000] for k, v in list((raw.headers or {}).items())[:32]},
            body_text=body_text,
            body_base64=body_b64,
        )
        if cap == 0 or len(letter.model_dump_json()) <= LETTER_BUDGET:
            return letter
        cap //= 4
