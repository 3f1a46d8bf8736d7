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
from ..adapters.repository import AllocationRepository, count_images
from ..service_layer.deadlines import sweep_deadlines
from ..service_layer.handlers import Allocator, handlers_by_consumer
from ..service_layer.queries import answer_query
from ..service_layer.terminal import TerminalHub
from ..settings import AllocatorSettings
from .terminal_http import TerminalApi

log = get_logger(__name__)


def build_register(settings: AllocatorSettings):
    async def register(rt: ServiceRuntime) -> None:
        assert rt.bus is not None and rt.pool is not None
        rt.bus.repositories = AllocationRepository
        allocator = Allocator(settings)
        for durable, handlers in handlers_by_consumer(allocator).items():
            rt.bus.subscribe(rt.consumer_spec(durable), handlers)
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
            result = await answer_query(pool, query)  # type: ignore[arg-type]
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
    """The slice terminal: the tenant's websocket, and the answers to the hosts' terminal requests. Every replica
    hears every host's requests (no queue group): only the one holding a session's websocket answers for it."""
    if settings.portal_token is None:
        log.warning(
            "terminal_api_disabled", why="GPUAAS_PORTAL_TOKEN is not set: the terminal never listens without one"
        )
        return
    assert rt.bus is not None and rt.nc is not None
    hub = TerminalHub(
        rt.bus.unit_of_work,
        session_max_s=settings.terminal_session_max_s,
        input_hold_s=settings.terminal_input_hold_s,
    )
    api = TerminalApi(hub, settings.portal_token, open_timeout_s=settings.terminal_open_timeout_s)
    answering: set[asyncio.Task[None]] = set()
    for type_, answer in (("node.terminal_output", hub.on_output), ("node.terminal_input", hub.on_input)):
        responder = terminal_responder(type_, answer)

        async def on_request(msg: Any, responder=responder) -> None:
            # An input ask is held until the tenant types: each request is answered on its own task, so one held
            # ask never delays another host's bytes.
            task = asyncio.create_task(responder(msg))
            answering.add(task)
            task.add_done_callback(answering.discard)

        every_host = str(spec_for(type_).address).replace("{node_id}", "*")
        await rt.nc.subscribe(every_host, cb=on_request)
    rt.ready_info["terminal_port"] = await api.start(settings.terminal_host, settings.terminal_port)
    rt.on_stop.append(api.stop)


def terminal_responder(type_: str, answer: Any):
    reply_type = spec_for(type_).reply
    assert reply_type is not None

    async def respond(msg: Any) -> None:
        if not msg.reply:
            return
        try:
            envelope, req = parse_message(msg.subject, msg.data)
        except PermanentError as exc:
            # A core request, not a stream message: nothing to dead-letter; the host hears nothing and gives up.
            log.warning("terminal_request_invalid", subject=msg.subject, code=exc.reason_code, reason=exc.reason[:300])
            return
        if envelope.type != type_:
            log.warning("terminal_request_invalid", subject=msg.subject, code="unexpected_type", reason=envelope.type)
            return
        result = await answer(req)
        if result is None:
            return  # another replica's session
        env = Envelope.wrap(
            reply_type,
            result.model_dump(mode="json"),
            producer="allocator",
            correlation_id=envelope.correlation_id,
            causation_id=envelope.event_id,
        )
        await msg.respond(env.model_dump_json().encode())

    return respond


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
