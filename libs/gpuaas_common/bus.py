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
from collections.abc import Callable, Mapping
from typing import Any

import asyncpg
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from pydantic import BaseModel

from .bus_budget import HostBudget
from .bus_dispatch import (
    HANDLED,
    FirstLock,
    Handler,
    HandlerContext,
    HeldDeadLetters,
    Refuse,
    Wanted,
    deliver,
    dispatch,
    retry_delay,
)
from .bus_gate import TrafficGate
from .bus_lanes import ORDERING_FIELDS, KeepAlive, KeyedLanes, lane_key, ordering_key
from .bus_parsing import PermanentError, decode_body, parse_message
from .contract import Envelope, spec_for
from .inbox import HostInbox
from .jetstream import PUBACK_TIMEOUT_S, ConsumerSpec
from .logging import get_logger
from .pull import PULL_EXPIRES_S, PullLoop
from .unit_of_work import UnitOfWork, no_repositories

# The bus is split by concern (bus_parsing, bus_lanes, bus_dispatch); this module wires them into `Bus` and
# stays the one place services and tests import the bus from.
__all__ = [
    "HANDLED",
    "ORDERING_FIELDS",
    "START_API_TIMEOUT_S",
    "Bus",
    "FirstLock",
    "Handler",
    "HandlerContext",
    "KeyedLanes",
    "PermanentError",
    "decode_body",
    "deliver",
    "lane_key",
    "ordering_key",
    "parse_message",
    "retry_delay",
]

log = get_logger(__name__)

# JetStream API calls at start (each durable's lookup) wait up to 15 s instead of nats-py's 5 s: on a 3-server
# cluster still settling its leaders on a loaded machine one took longer, and a service exits at start on that
# (nats_setup_failed; seen starting the chaos stack).
START_API_TIMEOUT_S = 15.0


def _pull_loop_ended(task: "asyncio.Task[None]") -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("pull_loop_died", task=task.get_name(), error=repr(task.exception()))


async def _drop(spec: ConsumerSpec, msg: Msg, free_place: Callable[[], None]) -> None:
    """A message over its host's budget: acknowledged, so it is neither handled nor redelivered."""
    try:
        await msg.ack()
    finally:
        free_place()
    HANDLED.labels(spec.durable, "over_budget").inc()


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
        # JetStream exchanges in flight on `nc` (publishes awaiting a PubAck, open pull requests): what a
        # credential switch waits for (`bus_gate`, `creds_renewal`). The outbox relay passes through it too.
        self.gate = TrafficGate()
        # A host's bus keeps its dead letters at home and counts them (bus_dispatch.HeldDeadLetters).
        self.held_dead_letters: HeldDeadLetters | None = None

    def subscribe(
        self,
        spec: ConsumerSpec,
        handlers: Mapping[str, Handler],
        *,
        transactional: bool = True,
        concurrency: int | None = None,
        first_lock: FirstLock | None = None,
        wanted: Wanted | None = None,
        host_budget: HostBudget | None = None,
        refuse: Refuse | None = None,
    ) -> None:
        """`first_lock(payload)` names the advisory lock every handler of this consumer takes first (the
        aggregate's, where the service keeps no row to lock); it then travels with the BEGIN.

        `wanted(payload)` False: the message is none of this consumer's business (a filter its subject cannot
        say, e.g. the shape of a lifecycle event): acknowledged as ignored, with no unit of work opened for it.

        `concurrency` > 1 keeps up to that many messages in flight at once, in order per aggregate
        (`ordering_key`: allocation, node, image, operation): one slow allocation holds up only itself. The
        pull loop asks for as many messages as there are free places; each message is handed to a task and
        acked by it after the handler.

        `host_budget`: the durable reads host-produced subjects; a node's message over its budget is acked and
        dropped at receipt, before it is parsed or takes a lane (`bus_budget`); one within it has its inbox row
        kept among its node's newest (`HostBudget.inbox_of`).

        `refuse(subject, decoded_body)` a reason: the message is refused before it is parsed (terminated, logged
        and counted as `refused`, never dead-lettered): the node agent's check that a task came on its type's own
        subject, whose senders the contract names."""
        if transactional and self.pool is None:
            raise ValueError("a transactional subscriber needs a database pool")
        if self.nc is None:
            raise ValueError("a bus without a connection only publishes")
        for type_ in handlers:
            spec_for(type_)  # fail at start-up on a typo, not at the first message
        self.consumers.append(spec)
        lanes = KeyedLanes()

        async def run(
            msg: Msg,
            decoded: Any,
            keep: KeepAlive,
            turn: "asyncio.Future[None] | None",
            done: Any,
            host: HostInbox | None,
        ) -> None:
            try:
                if turn is not None:
                    await turn  # the previous message of the same aggregate has been handled
                await self.dispatch(spec, handlers, msg, transactional, first_lock, decoded, wanted, refuse, host)
            finally:
                done()

        def start(msg: Msg, free_place: Callable[[], None]) -> None:
            host = None
            if host_budget is not None:
                if not host_budget.admit(msg.subject, len(msg.data)):
                    self._track(asyncio.create_task(_drop(spec, msg, free_place)))
                    return
                host = host_budget.inbox_of(msg.subject)
            # From receipt: a message waiting for its turn is in flight too.
            keep = KeepAlive(msg, spec.ack_wait_s)
            decoded = decode_body(msg.data)
            turn, lane_done = lanes.enter(lane_key(msg.subject, decoded))

            def done() -> None:
                lane_done()
                keep.stop()
                free_place()

            self._track(asyncio.create_task(run(msg, decoded, keep, turn, done, host)))

        places = concurrency or self.default_concurrency
        self._loops.append(PullLoop(self.nc, spec, start, places, expires_s=self.pull_expires_s, gate=self.gate))

    def _track(self, task: "asyncio.Task[None]") -> None:
        self._in_flight.add(task)
        task.add_done_callback(self._in_flight.discard)

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
        first_lock: FirstLock | None,
        decoded: Any,
        wanted: Wanted | None = None,
        refuse: Refuse | None = None,
        host: HostInbox | None = None,
    ) -> None:
        """One message, whose body `decode_body` decoded at receipt (`bus_dispatch.dispatch`)."""
        await dispatch(self, spec, handlers, msg, transactional, first_lock, decoded, wanted, refuse, host)

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
        async with self.gate.passage():
            ack = await self.js.publish(
                spec.subject(**subject_params),
                envelope.model_dump_json().encode(),
                headers={"Nats-Msg-Id": envelope.event_id},
                timeout=timeout,
            )
        if not ack.stream:
            raise RuntimeError(f"no PubAck stream for {type_}")
        return envelope
