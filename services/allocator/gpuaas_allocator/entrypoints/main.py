"""`gpuaas-allocator`: the allocation process manager."""

from __future__ import annotations

import asyncio
from typing import Any

import asyncpg

from gpuaas_common.bus import PermanentError, parse_message
from gpuaas_common.cancellation import stop_if_cancelled
from gpuaas_common.contract import Envelope, spec_for
from gpuaas_common.contract import messages as m
from gpuaas_common.db import DB_UNAVAILABLE
from gpuaas_common.identity.permissions import ADMIN, inbox_prefix
from gpuaas_common.logging import get_logger
from gpuaas_common.periodic import every
from gpuaas_common.runtime import ServiceRuntime, run_service

from ..adapters.metrics import QUERIES_REFUSED, allocations_reading
from ..adapters.repository import AllocationRepository, allocation_reads, count_images
from ..service_layer.deadlines import sweep_deadlines
from ..service_layer.handlers import Allocator, handlers_by_consumer
from ..service_layer.queries import answer_query
from ..service_layer.terminal import TerminalHub, TerminalLimits
from ..settings import AllocatorSettings
from .terminal_http import TerminalApi

log = get_logger(__name__)

# The durables fed by hosts (gpuaas.node.<id>.report.*): each node's messages have a budget (bus_budget).
HOST_FED = frozenset({"allocator-task-results", "allocator-enrolments"})


def build_register(settings: AllocatorSettings):
    async def register(rt: ServiceRuntime) -> None:
        assert rt.bus is not None and rt.pool is not None
        rt.bus.repositories = AllocationRepository
        allocator = Allocator(settings)
        for durable, handlers in handlers_by_consumer(allocator).items():
            budget = rt.host_budget(durable) if durable in HOST_FED else None
            rt.bus.subscribe(rt.consumer_spec(durable), handlers, host_budget=budget)
        known = {"count": 0}

        async def refresh() -> None:
            known["count"] = await count_images(rt.pool)  # type: ignore[arg-type]

        # Ready only once the image catalog has reached us: without it every request is rejected. Each replica
        # polls for itself; the poll only reads.
        rt.health.checks["images_known"] = lambda: known["count"] > 0
        rt.spawn(_poll(refresh), "image-readiness")

        # Reads for portals and ops: core request/reply, one queue group over every replica.
        assert rt.nc is not None
        pool = rt.pool
        responder = query_responder(pool, open_server=not rt.identity.creds_file)
        await rt.nc.subscribe(spec_for("allocation.query").subject(), queue="allocator", cb=responder)

        # The control plane owns node-task deadlines (a silent host fails its allocation) and placement deadlines
        # (a lost placement is asked for again): see deadlines.py and redrive.py. Every replica sweeps; the rows
        # are taken with FOR UPDATE SKIP LOCKED, so each overdue one is handled by exactly one of them.
        # /metrics: allocations by state and shape, and the oldest in each live state (adapters/metrics.py).
        rt.add_reading("allocations", allocations_reading(pool))

        bus = rt.bus
        rt.spawn(
            every(
                settings.task_deadline_sweep_interval_s,
                lambda: sweep_deadlines(bus.unit_of_work, settings),
                "task_deadline_sweep",
            ),
            "task-deadlines",
        )
        await serve_terminal(rt, settings)

    return register


def answerable_reply(reply: str, *, open_server: bool) -> bool:
    """Whether `reply` is the inbox of an identity that may ask (`_INBOX_<asker>.…`: the contract's producers of
    allocation.query, and the admin's break-glass CLI). The server lets us publish once to any reply subject we
    were sent (our `resp` right), so an asker that names a stream subject as its reply (an `ops` user giving
    `gpuaas.image.event.activated`) would have us write our answer into that stream. Only an identity can
    subscribe to its own inbox prefix, so an answer there reaches the asker and nothing stores it. On an open
    dev server (no identities) askers use the shared `_INBOX.` prefix."""
    askers = (*spec_for("allocation.query").producers, ADMIN)
    if any(reply.startswith(f"{inbox_prefix(name)}.") for name in askers):
        return True
    return open_server and reply.startswith("_INBOX.")


def query_responder(pool: asyncpg.Pool, *, open_server: bool = False):
    """Answer `allocation.query` on the request's reply subject, when that is an asker's own inbox
    (`answerable_reply`; any other is refused: logged, counted, unanswered); a request that breaks the contract
    gets an `invalid` answer saying why, so the asker never waits for nothing."""
    reads = allocation_reads(pool)

    async def on_query(msg: Any) -> None:
        if not msg.reply:
            return  # nobody to answer: a publish, not a request
        if not answerable_reply(msg.reply, open_server=open_server):
            QUERIES_REFUSED.inc()
            log.warning("allocation_query_refused", reply=msg.reply[:200], why="the reply subject is no asker's inbox")
            return
        correlation, cause = "query", None
        try:
            envelope, query = parse_message(msg.subject, msg.data)
            correlation, cause = envelope.correlation_id, envelope.event_id
            result = await answer_query(reads, query)  # type: ignore[arg-type]
        except PermanentError as exc:
            result = m.AllocationQueryResult(status="invalid", reason=exc.reason[:2048])
        except DB_UNAVAILABLE as exc:
            log.warning("allocation_query_failed", error=str(exc)[:300])
            return  # the asker times out and says the allocator did not answer
        env = Envelope.wrap(
            "allocation.query_result",
            result.model_dump(mode="json"),
            producer="allocator",
            correlation_id=correlation,
            causation_id=cause,
        )
        await msg.respond(env.model_dump_json().encode())

    return on_query


async def serve_terminal(rt: ServiceRuntime, settings: AllocatorSettings) -> None:
    """The slice terminal: the tenant's websocket, and the answers to the hosts' terminal requests. A replica
    listens to a host's terminal subjects only while it holds a session on that host (NodeListeners), so the
    replica holding a session's websocket is the one its host's requests reach."""
    if settings.terminal_assertion_secret is None:
        log.warning(
            "terminal_api_disabled",
            why="GPUAAS_TERMINAL_ASSERTION_SECRET is not set: the terminal never listens without the portal's key",
        )
        return
    assert rt.bus is not None and rt.nc is not None and rt.pool is not None
    limits = TerminalLimits(
        output_buffer=settings.terminal_output_buffer_bytes,
        input_window=settings.terminal_input_window_bytes,
        per_tenant=settings.terminal_sessions_per_tenant,
        node_answers=settings.terminal_node_answers,
    )
    listeners = NodeListeners(rt.nc, linger_s=settings.terminal_input_hold_s + 20.0)
    hub = TerminalHub(
        rt.bus.unit_of_work,
        session_max_s=settings.terminal_session_max_s,
        input_hold_s=settings.terminal_input_hold_s,
        limits=limits,
        interest=listeners,
    )
    listeners.callbacks = {
        type_: terminal_intake(hub, type_, answer)
        for type_, answer in (("node.terminal_output", hub.on_output), ("node.terminal_input", hub.on_input))
    }
    api = TerminalApi(hub, settings.terminal_assertion_secret, open_timeout_s=settings.terminal_open_timeout_s)
    rt.add_reading("terminal", hub.reading)
    # The claims other replicas read to tell a live session from one whose replica died (domain: replica_gone).
    rt.spawn(every(limits.claim_stale_s / 3, hub.renew_claims, "terminal_claims"), "terminal-claims")
    rt.ready_info["terminal_port"] = await api.start(settings.terminal_host, settings.terminal_port)
    rt.ready_info["terminal_replica"] = hub.replica_id
    rt.on_stop.append(api.stop)


# nats-py's own queue for a subscription, before our callback: bounded by messages and bytes, so a host that
# publishes faster than the callback drops (a slow consumer on that subscription only) instead of growing it.
TERMINAL_PENDING_MSGS = 1024
TERMINAL_PENDING_BYTES = 4 * 1024 * 1024


class NodeListeners:
    """Subscriptions to one host's two terminal subjects, held while this replica has a live session on the
    host, let go `linger_s` after its last one ends (the host then still hears `closed` for it). No queue group:
    two replicas with sessions on one host both hear it, and each answers only its own sessions."""

    def __init__(self, nc: Any, *, linger_s: float) -> None:
        self.nc = nc
        self.linger_s = linger_s
        self.callbacks: dict[str, Any] = {}
        self._held: dict[str, int] = {}
        self._subs: dict[str, list[Any]] = {}
        self._later: dict[str, asyncio.TimerHandle] = {}

    async def hold(self, node_id: str) -> None:
        self._held[node_id] = self._held.get(node_id, 0) + 1
        pending = self._later.pop(node_id, None)
        if pending is not None:
            pending.cancel()
        if node_id in self._subs:
            return
        subs = []
        for type_, cb in self.callbacks.items():
            subject = str(spec_for(type_).address).replace("{node_id}", node_id)
            subs.append(
                await self.nc.subscribe(
                    subject,
                    cb=cb,
                    pending_msgs_limit=TERMINAL_PENDING_MSGS,
                    pending_bytes_limit=TERMINAL_PENDING_BYTES,
                )
            )
        self._subs[node_id] = subs
        await self.nc.flush()  # the server knows of us before the open task reaches the host

    def let_go(self, node_id: str) -> None:
        left = self._held.get(node_id, 0) - 1
        if left > 0:
            self._held[node_id] = left
            return
        self._held.pop(node_id, None)
        if node_id in self._subs and node_id not in self._later:
            self._later[node_id] = asyncio.get_running_loop().call_later(self.linger_s, self._drop, node_id)

    def _drop(self, node_id: str) -> None:
        self._later.pop(node_id, None)
        if node_id in self._held:
            return
        for sub in self._subs.pop(node_id, []):
            asyncio.get_running_loop().create_task(sub.unsubscribe())

    def listening(self) -> set[str]:
        return set(self._subs)


def terminal_intake(hub: TerminalHub, type_: str, answer: Any):
    """The callback of a host's terminal subject. Runs on the subscription's own task, one message after another:
    it parses and decides before anything is allocated. Not this replica's session, or the host's answer slots
    all taken: dropped (counted, one log line per window), no task. Otherwise one task answers it (an input ask
    is held until the tenant types), bounded per host by the hub's slots."""
    reply_type = spec_for(type_).reply
    assert reply_type is not None
    answering: set[asyncio.Task[None]] = set()  # held so that no answer is collected half-way

    async def on_request(msg: Any) -> None:
        if not msg.reply:
            return
        try:
            envelope, req = parse_message(msg.subject, msg.data)
        except PermanentError as exc:
            # A core request, not a stream message: nothing to dead-letter; the host hears nothing and gives up.
            hub.drop("invalid", subject=msg.subject, code=exc.reason_code, reason=exc.reason[:300])
            return
        if envelope.type != type_:
            hub.drop("invalid", subject=msg.subject, code="unexpected_type", reason=envelope.type[:100])
            return
        node_id = req.node_id  # type: ignore[attr-defined]
        if not hub.answers_for(req.session_id, node_id):  # type: ignore[attr-defined]
            hub.drop("unknown_session", node_id=node_id)
            return
        if not hub.admit(node_id):
            hub.drop("node_busy", node_id=node_id)
            return
        task = asyncio.get_running_loop().create_task(_answer(msg, envelope, req, node_id))
        answering.add(task)
        task.add_done_callback(answering.discard)

    async def _answer(msg: Any, envelope: Envelope, req: Any, node_id: str) -> None:
        try:
            result = await answer(req)
            if result is None:
                return  # not answered on purpose (an ack held past its wait): the host asks again
            env = Envelope.wrap(
                reply_type,
                result.model_dump(mode="json"),
                producer="allocator",
                correlation_id=envelope.correlation_id,
                causation_id=envelope.event_id,
            )
            await msg.respond(env.model_dump_json().encode())
        except Exception as exc:  # noqa: BLE001 - one answer failing (a closed connection) ends only that answer
            log.warning("terminal_answer_failed", node_id=node_id, error=f"{type(exc).__name__}: {exc}"[:300])
        finally:
            hub.done(node_id)

    return on_request


async def _poll(fn) -> None:
    while True:
        stop_if_cancelled()
        try:
            await fn()
        except DB_UNAVAILABLE:
            pass  # readiness simply stays false while the database is away
        await asyncio.sleep(0.5)


def main() -> None:
    run_service(
        "allocator",
        AllocatorSettings,
        build_register,
        schema="allocator",
        migrations_package="gpuaas_allocator.migrations",
    )


if __name__ == "__main__":
    main()
