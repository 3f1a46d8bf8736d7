"""A host's messages have a budget where they are consumed (gpuaas_common.bus_budget), over real nats-server and
Postgres: a host flooding its drift reports leaves the scheduler as many rows as its budget admits, every message
acked (none redelivered, none pending), the rest dropped and counted before they are parsed, so none is half
applied (no inbox row, no drift row); another host's reports are untouched. ops-view's follower applies a
flooding host's task progress within the budget too, and refuses hosts' dead letters altogether.

The budgets' clock stands still in these tests: no token comes back during a run, so the counts are exact."""

from __future__ import annotations

import dataclasses
import uuid
from datetime import datetime, timedelta, timezone
from typing import Any

import nats
import nats.errors
import pytest
from prometheus_client import REGISTRY

from gpuaas_common.bus import Bus
from gpuaas_common.bus_budget import HostBudget, host_of
from gpuaas_common.contract import Envelope
from gpuaas_common.contract import messages as m
from gpuaas_common.jetstream import CONSUMER_BY_NAME, FOLLOWERS, ensure_consumer, node_agent_consumer, provision
from gpuaas_common.natsconn import NatsIdentity
from gpuaas_common.retention import RetentionSweeper
from gpuaas_dev.testing.waiting import eventually
from gpuaas_node_agent.adapters.host_link import HostLink
from gpuaas_ops_view.entrypoints import main as ops_view_main
from gpuaas_ops_view.entrypoints.follow import StreamFollower
from gpuaas_ops_view.service_layer.projection import Message
from gpuaas_scheduler.adapters import synthetic
from gpuaas_scheduler.entrypoints import main as scheduler_main
from gpuaas_scheduler.service_layer.handlers import Scheduler, evidence_handlers

from .scheduler_db import scheduler_pool
from .test_node_agent_tasks import publish, spy  # noqa: F401  (fixtures)
from .test_ops_view_batches import T0, _msg, nc, pool  # noqa: F401  (fixtures)


def _dropped(consumer: str) -> float:
    return REGISTRY.get_sample_value("gpuaas_host_messages_dropped_total", {"consumer": consumer}) or 0.0


def test_only_a_hosts_own_subjects_are_budgeted() -> None:
    assert host_of("gpuaas.node.n1.report.drift") == "n1"
    assert host_of("gpuaas.dlq.node-agent-n1") == "n1"
    assert host_of("gpuaas.node.n1.tasks") is None
    assert host_of("gpuaas.allocation.requested") is None
    budget = HostBudget("c", messages_per_min=2, bytes_per_min=100, clock=lambda: 0.0)
    assert [budget.admit("gpuaas.node.n1.report.drift", 10) for _ in range(3)] == [True, True, False]
    assert budget.admit("gpuaas.node.n1.report.drift", 0) is False
    # Bytes are a budget of their own: one message over a minute's bytes never passes.
    assert budget.admit("gpuaas.node.n2.report.drift", 101) is False
    assert budget.admit("gpuaas.allocation.requested", 10_000) is True


def test_the_buckets_refill_at_the_rate_and_log_once_a_window(caplog: Any) -> None:
    now = [0.0]
    budget = HostBudget("c", messages_per_min=60, bytes_per_min=1e9, clock=lambda: now[0])
    assert sum(budget.admit("gpuaas.node.n1.report.x", 1) for _ in range(100)) == 60
    now[0] = 10.0  # ten seconds: ten messages' worth
    assert sum(budget.admit("gpuaas.node.n1.report.x", 1) for _ in range(100)) == 10
    assert budget.dropped == {"n1": 130}


async def test_a_flooding_host_leaves_the_scheduler_as_many_drift_rows_as_its_budget(
    fresh_db,
    nats_server,
    publish,  # noqa: F811
    spy,  # noqa: F811
) -> None:
    spec = CONSUMER_BY_NAME["scheduler-node-drift"]
    budget = HostBudget(spec.durable, messages_per_min=5, bytes_per_min=1e9, clock=lambda: 0.0)
    before = _dropped(spec.durable)
    async with scheduler_pool(fresh_db) as spool:
        async with spool.acquire() as conn:
            await synthetic.build(conn, slice_hosts=2, prefix=f"b{uuid.uuid4().hex[:4]}")
            flooder, quiet = [r["node_id"] for r in await conn.fetch("SELECT node_id FROM nodes ORDER BY node_id")]
        bus_nc = await nats.connect(nats_server.url)
        nc_ = await nats.connect(nats_server.url)
        await ensure_consumer(nc_.jetstream(), spec)
        bus = Bus(bus_nc, nc_.jetstream(), service="scheduler", schema="scheduler", pool=spool, retry_delays_s=(0.05,))
        bus.subscribe(spec, evidence_handlers(Scheduler())["scheduler-node-drift"], host_budget=budget)
        await bus.start()
        sent: list[str] = []
        try:
            for i in range(40):  # each report newer by a second: each would be a row of its own
                report = m.NodeDriftReported(node_id=flooder, checked_at=T0 + timedelta(seconds=i))
                env = await publish("node.drift_reported", report, correlation_id=flooder, node_id=flooder)
                sent.append(env.event_id)
            for i in range(2):
                report = m.NodeDriftReported(node_id=quiet, checked_at=T0 + timedelta(seconds=i))
                env = await publish("node.drift_reported", report, correlation_id=quiet, node_id=quiet)
                sent.append(env.event_id)

            async def settled() -> bool:
                info = await nc_.jetstream().consumer_info(spec.stream, spec.durable)
                return info.num_pending == 0 and info.num_ack_pending == 0

            await eventually(settled, what="every report acked")
            async with spool.acquire() as conn:
                rows = dict(
                    await conn.fetch("SELECT node_id, count(*) FROM node_drift_reports GROUP BY node_id ORDER BY 1")
                )
                # This test's reports only: the stream also holds reports earlier tests sent other hosts.
                inbox = await conn.fetchval(
                    "SELECT count(*) FROM inbox WHERE consumer = $1 AND message_id = ANY($2::text[])",
                    spec.durable,
                    sent,
                )
        finally:
            await bus.stop()
            await bus_nc.close()
            await nc_.drain()
    assert rows == {flooder: 5, quiet: 2}
    # Dropped before parsing: no inbox row, no effect, for any of the 35.
    assert inbox == 7
    assert budget.dropped == {flooder: 35}
    assert _dropped(spec.durable) - before == 35
    assert len(spy.of_type("node.drift_reported", node_id=flooder)) == 40


async def test_a_hosts_inbox_rows_at_a_host_fed_consumer_stay_within_the_cap_the_newest_kept(
    fresh_db,
    nats_server,
    publish,  # noqa: F811
    spy,  # noqa: F811
) -> None:
    """Issue 38: each admitted message left an inbox row for the 8 days rows live (a hostile host: +1900 rows in
    10 minutes at one consumer). Now a host-fed durable's row names the node and the claim keeps that (consumer,
    node)'s newest `inbox_rows_per_node`: right after each of a flooding host's messages its group holds at most
    the cap, the newest stay; another host's rows, and every row of a durable without a budget, stay as they were."""
    cap, flood = 4, 11
    tag = uuid.uuid4().hex[:6]
    spec = dataclasses.replace(CONSUMER_BY_NAME["scheduler-node-drift"], durable=f"hb-inbox-{tag}")
    unbudgeted = dataclasses.replace(spec, durable=f"hb-inbox-plain-{tag}")
    budget = HostBudget(spec.durable, messages_per_min=1e6, bytes_per_min=1e9, inbox_rows_per_node=cap)
    async with scheduler_pool(fresh_db) as spool:
        async with spool.acquire() as conn:
            await synthetic.build(conn, slice_hosts=2, prefix=f"i{tag[:4]}")
            flooder, quiet = [r["node_id"] for r in await conn.fetch("SELECT node_id FROM nodes ORDER BY node_id")]
        bus_nc = await nats.connect(nats_server.url)
        nc_ = await nats.connect(nats_server.url)
        for durable in (spec, unbudgeted):
            await ensure_consumer(nc_.jetstream(), durable)
        bus = Bus(bus_nc, nc_.jetstream(), service="scheduler", schema="scheduler", pool=spool, retry_delays_s=(0.05,))
        handlers = evidence_handlers(Scheduler())["scheduler-node-drift"]
        bus.subscribe(spec, handlers, host_budget=budget)
        bus.subscribe(unbudgeted, handlers)
        await bus.start()

        async def group(consumer: str, node: str | None) -> list[str]:
            rows = await spool.fetch(
                "SELECT message_id FROM inbox WHERE consumer = $1 AND node_id IS NOT DISTINCT FROM $2 "
                "ORDER BY received_at",
                consumer,
                node,
            )
            return [r["message_id"] for r in rows]

        async def report(node: str, i: int) -> str:
            env = await publish(
                "node.drift_reported",
                m.NodeDriftReported(node_id=node, checked_at=T0 + timedelta(seconds=i)),
                correlation_id=node,
                node_id=node,
            )
            for consumer in (spec.durable, unbudgeted.durable):
                await eventually(
                    lambda c=consumer: spool.fetchval(
                        "SELECT 1 FROM inbox WHERE consumer = $1 AND message_id = $2", c, env.event_id
                    ),
                    what=f"{consumer} handled {env.event_id}",
                )
            return env.event_id

        try:
            quiet_sent = [await report(quiet, i) for i in range(2)]
            flooder_sent: list[str] = []
            for i in range(flood):
                flooder_sent.append(await report(flooder, i))
                assert await group(spec.durable, flooder) == flooder_sent[-cap:]  # right after each message
            kept_flooder = await group(spec.durable, flooder)
            kept_quiet = await group(spec.durable, quiet)
            plain = set(await group(unbudgeted.durable, None))
            plain_with_node = await spool.fetchval(
                "SELECT count(*) FROM inbox WHERE consumer = $1 AND node_id IS NOT NULL", unbudgeted.durable
            )
        finally:
            await bus.stop()
            await bus_nc.close()
            await nc_.drain()
    assert kept_flooder == flooder_sent[-cap:] and len(flooder_sent) == flood
    assert kept_quiet == quiet_sent
    # Without a budget the durable is not host-fed: its rows name no node and none went.
    assert set(quiet_sent + flooder_sent) <= plain and plain_with_node == 0
    assert budget.dropped == {}


def _host_message(seq: int, type_: str, payload: Any, subject: str) -> Message:
    env = Envelope.wrap(type_, payload.model_dump(mode="json"), producer="node-agent", correlation_id="flood")
    return Message("NODE_REPORTS", seq, subject, env.model_dump_json().encode())


def _follower(nc_: Any, pool_: Any, stream: str, budget: HostBudget) -> StreamFollower:
    js = nc_.jetstream()
    [spec] = [s for s in FOLLOWERS if s.stream == stream]
    letters = Bus(nc_, js, service="ops-view", schema=None, pool=None)
    name = spec.durable.replace("ops-view", f"hb-{uuid.uuid4().hex[:8]}", 1)
    return StreamFollower(nc_, js, pool_, spec, name=name, dead_letters=letters, batch=64, budget=budget)


async def test_ops_view_applies_a_flooding_hosts_progress_within_its_budget(nc, pool) -> None:  # noqa: F811
    budget = HostBudget("ops-view-node-reports", messages_per_min=10, bytes_per_min=1e9, clock=lambda: 0.0)
    follower = _follower(nc, pool, "NODE_REPORTS", budget)
    messages = [
        _host_message(
            i + 1,
            "node.task_progress",
            m.NodeTaskProgress(
                task_id=f"t-{i}",
                allocation_id=uuid.uuid4(),
                node_id="flood",
                task_type="slice.vm_provision",
                phase="boot",
            ),
            "gpuaas.node.flood.report.task_progress",
        )
        for i in range(50)
    ]
    await follower._apply([_msg(message) for message in messages])
    assert follower.position == 50  # the dropped ones are passed, never read again
    async with pool.acquire() as conn:
        assert await conn.fetchval("SELECT count(*) FROM node_task_phases") == 10
        assert await conn.fetchval("SELECT last_seq FROM stream_positions WHERE stream = 'NODE_REPORTS'") == 50
    assert budget.dropped == {"flood": 40}


async def test_ops_view_stores_no_dead_letter_a_host_sent(nc, pool) -> None:  # noqa: F811
    """Agents report a count of their dead letters now; one still sent (a tenant's host, by hand) is refused."""
    budget = HostBudget.refusing("ops-view-dlq")
    follower = _follower(nc, pool, "DLQ", budget)
    letter = m.DeadLetter(
        consumer="allocator-requested",
        stream="ALLOCATIONS",
        subject="x",
        reason_code="handler_error",
        reason="r" * 8000,
        body_text="b" * 8000,
    )
    forged = [
        Message("DLQ", i + 1, "gpuaas.dlq.node-agent-flood", _host_message(0, "dead_letter", letter, "").data)
        for i in range(20)
    ]
    service_letter = Message("DLQ", 21, "gpuaas.dlq.allocator-requested", forged[0].data)
    await follower._apply([_msg(message) for message in [*forged, service_letter]])
    async with pool.acquire() as conn:
        subjects = [r["subject"] for r in await conn.fetch("SELECT subject FROM dead_letters")]
    assert subjects == ["gpuaas.dlq.allocator-requested"]
    assert budget.dropped == {"flood": 20}


async def test_a_hosts_agent_keeps_its_dead_letters_at_home_and_counts_them(nats_server, publish, spy) -> None:  # noqa: F811
    """Hosts are off the DLQ path: a task the agent cannot read is logged and counted on the host, and nothing
    (no body, which may carry a tenant's keys) goes to gpuaas.dlq.node-agent-<id>."""
    node_id = f"hb-{uuid.uuid4().hex[:6]}"
    link = HostLink(node_id, NatsIdentity([nats_server.url], insecure_dev=True), retry_delays_s=(0.05,))
    bus = await link.open(retry_forever=False)
    spec = node_agent_consumer(node_id)
    await provision(bus.js, [spec])
    dlq = await bus.js.subscribe(f"gpuaas.dlq.{spec.durable}", ordered_consumer=True)
    bus.subscribe(spec, {"slice.topology_discover": _never_called}, transactional=False)
    await link.start()
    try:
        spy.allow_invalid(b"{not json")
        await bus.js.publish(f"gpuaas.node.{node_id}.tasks.slice.vm_release", b"{not json")
        assert bus.held_dead_letters is not None
        held = bus.held_dead_letters
        await eventually(lambda: held.count == 1, what="the unreadable task held")
        assert held.by_reason == {"not_json": 1}

        async def acked() -> bool:
            info = await bus.js.consumer_info(spec.stream, spec.durable)
            return info.num_pending == 0 and info.num_ack_pending == 0

        await eventually(acked, what="the task acked")
        with pytest.raises(nats.errors.TimeoutError):
            await dlq.next_msg(timeout=0.5)
    finally:
        await dlq.unsubscribe()
        await link.close()
    # What the agent reports instead: the count, on its drift report (the contract's field).
    report = m.NodeDriftReported(node_id=node_id, checked_at=T0, dead_lettered=held.count)
    assert report.model_dump(mode="json")["dead_lettered"] == 1


async def _never_called(ctx: Any) -> None:
    raise AssertionError("an unreadable task reached a handler")


async def test_the_rows_hosts_make_are_pruned_by_age_and_capped_per_host(fresh_db, pool) -> None:  # noqa: F811
    """N2: drift reports (scheduler), task phases and dead letters (ops-view) were never pruned. The sweep keeps
    each host's newest `per_node`, drops the rest older than the retention, and never a host's newest."""
    day = timedelta(days=1)
    now = datetime.now(timezone.utc)
    async with scheduler_pool(fresh_db) as spool:
        async with spool.acquire() as conn:
            await synthetic.build(conn, slice_hosts=2, prefix=f"r{uuid.uuid4().hex[:4]}")
            busy, quiet = [r["node_id"] for r in await conn.fetch("SELECT node_id FROM nodes ORDER BY node_id")]
            reports = [(busy, now - i * day) for i in range(30)] + [(quiet, now - (40 + i) * day) for i in range(3)]
            await conn.executemany(
                "INSERT INTO node_drift_reports (event_id, node_id, checked_at, drift) VALUES ($1, $2, $3, '[]')",
                [(str(uuid.uuid4()), node, at) for node, at in reports],
            )
        sweeper = RetentionSweeper(
            spool,
            "scheduler",
            inbox_retention_s=8 * 86400,
            idempotency_retention_s=8 * 86400,
            host_rows=scheduler_main.HOST_ROWS,
            host_rows_retention_s=20 * 86400,
            host_rows_per_node=25,
            batch_size=4,
        )
        deleted = await sweeper.sweep()
        async with spool.acquire() as conn:
            kept = await conn.fetch("SELECT node_id, checked_at FROM node_drift_reports ORDER BY checked_at DESC")
    assert deleted is not None and deleted["node_drift_reports"] == 33 - 21
    # The busy host: its 20 days within the retention (under the cap); the quiet one: only its newest.
    assert [r["checked_at"] for r in kept if r["node_id"] == busy] == [now - i * day for i in range(20)]
    assert [r["checked_at"] for r in kept if r["node_id"] == quiet] == [now - 40 * day]

    async with pool.acquire() as conn:
        await conn.execute(
            "INSERT INTO node_tasks (task_id, node_id, status, updated_at) VALUES ('t-1', 'n1', 'sent', now())"
        )
        # A phase names the host that reported it; those written before it did and whose task no row holds, none.
        phases = [("t-1", i, "n1") for i in range(20)] + [(f"forged-{i}", 100 + i, None) for i in range(20)]
        await conn.executemany(
            "INSERT INTO node_task_phases (task_id, stream_seq, phase, at, node_id) VALUES ($1, $2, 'boot', $3, $4)",
            [(task, seq, now - timedelta(seconds=seq), node) for task, seq, node in phases],
        )
        await conn.executemany(
            "INSERT INTO dead_letters (dlq_seq, subject, consumer, stream, origin_subject, reason_code, reason, at) "
            "VALUES ($1, 'gpuaas.dlq.c', $2, 'S', 'x', 'not_json', 'r', $3)",
            [(i, f"c{i % 2}", now - timedelta(seconds=i)) for i in range(30)],
        )
    sweeper = RetentionSweeper(
        pool,
        "ops_view",
        inbox_retention_s=8 * 86400,
        idempotency_retention_s=8 * 86400,
        host_rows=ops_view_main.HOST_ROWS,
        host_rows_per_node=5,
    )
    await sweeper.sweep()
    async with pool.acquire() as conn:
        left = await conn.fetch("SELECT task_id, stream_seq FROM node_task_phases ORDER BY stream_seq")
        letters = await conn.fetch("SELECT consumer, dlq_seq FROM dead_letters ORDER BY dlq_seq")
    assert [tuple(r) for r in letters] == [(f"c{i % 2}", i) for i in range(10)]  # the newest 5 of each consumer
    # The host keeps its newest 5 phases; those naming no host share one cap of 5.
    assert [tuple(r) for r in left] == [("t-1", i) for i in range(5)] + [(f"forged-{i}", 100 + i) for i in range(5)]
