"""The shared plumbing across real process boundaries: nats-server and Postgres."""

from __future__ import annotations

import asyncio
import json
import uuid
from dataclasses import replace

import asyncpg
import nats
import pytest
from nats.js.api import DiscardPolicy, StorageType

from gpuaas_common import inbox
from gpuaas_common.bus import Bus, HandlerContext, PermanentError
from gpuaas_common.contract import Envelope, derived_event_id
from gpuaas_common.contract import messages as m
from gpuaas_common.db import BackendPids
from gpuaas_common.jetstream import (
    CONSUMER_BY_NAME,
    REPORTS_PER_SUBJECT,
    STREAM_BY_NAME,
    ConsumerSpec,
    ensure_consumer,
    provision,
)
from gpuaas_common.migrations import apply_migrations
from gpuaas_common.outbox import EventCollector, OutboxRelay, OutboxWriter, notice_payload, pending_statement
from gpuaas_dev.testing.bus_spy import BusSpy
from gpuaas_dev.testing.durables import durable_at_end
from gpuaas_dev.testing.waiting import eventually


@pytest.fixture
def writers() -> BackendPids:
    """The pool's backends, as the runtime hands them to its relay: the senders whose NOTIFYs carry rows."""
    return BackendPids()


@pytest.fixture
async def outbox_db(fresh_db, writers):
    conn = await asyncpg.connect(fresh_db)
    await apply_migrations(conn, "svc", None)
    await conn.close()
    pool = await asyncpg.create_pool(fresh_db, server_settings={"search_path": "svc"}, init=writers.register)
    yield fresh_db, pool
    await pool.close()


def _release_requested(alloc: uuid.UUID) -> m.AllocationReleaseRequested:
    return m.AllocationReleaseRequested(allocation_id=alloc, reason="test")


async def test_provision_is_idempotent_and_updates_a_changed_consumer(js):
    spec = ConsumerSpec("plumbing-probe", "DLQ", "gpuaas.dlq.plumbing-probe", max_deliver=3)
    assert await ensure_consumer(js, spec) == "created"
    assert await ensure_consumer(js, spec) == "unchanged"
    changed = ConsumerSpec("plumbing-probe", "DLQ", "gpuaas.dlq.plumbing-probe", max_deliver=5)
    assert await ensure_consumer(js, changed) == "updated"
    info = await js.consumer_info("DLQ", "plumbing-probe")
    assert info.config.max_deliver == 5
    again = await provision(js)
    assert set(again.values()) == {"unchanged"}


async def test_provision_bounds_a_stream_provisioned_before_it_had_bounds(js):
    """An older deployment's streams had only an age limit: provisioning gives each its byte bound, per-subject
    bound and discard policy in place, so NODE_REPORTS keeps a host's flood to its own subjects and NODE_TASKS
    refuses rather than drops."""
    for spec in (STREAM_BY_NAME["NODE_REPORTS"], STREAM_BY_NAME["NODE_TASKS"]):
        old = replace(spec.config(StorageType.FILE), max_bytes=-1, max_msgs_per_subject=-1, discard=DiscardPolicy.OLD)
        await js.update_stream(old)
    outcome = await provision(js)
    assert outcome["stream:NODE_REPORTS"] == outcome["stream:NODE_TASKS"] == "updated"
    reports = (await js.stream_info("NODE_REPORTS")).config
    assert (reports.max_bytes, reports.max_msgs_per_subject, reports.discard) == (
        STREAM_BY_NAME["NODE_REPORTS"].max_bytes,
        REPORTS_PER_SUBJECT,
        DiscardPolicy.OLD,
    )
    tasks = (await js.stream_info("NODE_TASKS")).config
    assert tasks.discard == DiscardPolicy.NEW and 0 < (tasks.max_bytes or 0) == STREAM_BY_NAME["NODE_TASKS"].max_bytes
    assert set((await provision(js)).values()) == {"unchanged"}


async def test_provision_moves_a_single_filter_durable_to_its_several_filters(js):
    """An older deployment's durable on one wildcard filter is updated in place to the filters declared now
    (what the admin's provisioning does at an upgrade); it keeps its name and place in the stream."""
    spec = CONSUMER_BY_NAME["scheduler-allocation-events"]
    old = ConsumerSpec(spec.durable + "-upgrade", spec.stream, "gpuaas.allocation.event.>")
    assert await ensure_consumer(js, old) == "created"
    now = replace(spec, durable=old.durable)
    assert await ensure_consumer(js, now) == "updated"
    info = await js.consumer_info(spec.stream, old.durable)
    assert sorted(info.config.filter_subjects or []) == sorted(spec.filters) and not info.config.filter_subject
    assert await ensure_consumer(js, now) == "unchanged"
    assert await ensure_consumer(js, now, create=False) == "bound"
    await js.delete_consumer(spec.stream, old.durable)


async def test_relay_publishes_everything_in_per_aggregate_order_with_msg_id(js, outbox_db, nats_server):
    dsn, pool = outbox_db
    aggregates = [uuid.uuid4() for _ in range(10)]
    written: dict[str, list[str]] = {str(a): [] for a in aggregates}
    for _round in range(10):
        async with pool.acquire() as conn, conn.transaction():
            writer = OutboxWriter(conn, "svc", "test")
            for agg in aggregates:
                env = await writer.add("allocation.release_requested", _release_requested(agg), aggregate_id=str(agg))
                written[str(agg)].append(env.event_id)
    spy = await BusSpy(nats_server.url, "gpuaas.allocation.release_requested").start()
    relay = OutboxRelay(dsn, "svc", js, batch_size=37, poll_interval_s=0.2)
    task = asyncio.create_task(relay.run())
    try:
        await spy.wait_for(lambda: len(spy.messages) >= 100, what="100 relayed events")
        await eventually(lambda: _outbox_empty(pool))
    finally:
        relay.stop()
        await task
        await spy.stop()
    seen: dict[str, list[str]] = {}
    for _, data in spy.messages:
        seen.setdefault(data["payload"]["allocation_id"], []).append(data["event_id"])
    assert seen == written
    assert spy.violations == []


async def test_relay_does_not_skip_a_slow_transaction_that_commits_after_a_newer_one(js, outbox_db, nats_server):
    dsn, pool = outbox_db
    spy = await BusSpy(nats_server.url, "gpuaas.allocation.release_requested").start()
    relay = OutboxRelay(dsn, "svc", js, poll_interval_s=0.2)
    task = asyncio.create_task(relay.run())
    slow_agg, fast_agg = uuid.uuid4(), uuid.uuid4()
    try:
        slow = await asyncpg.connect(dsn, server_settings={"search_path": "svc"})
        tx = slow.transaction()
        await tx.start()
        await OutboxWriter(slow, "svc", "test").add(
            "allocation.release_requested", _release_requested(slow_agg), aggregate_id=str(slow_agg)
        )
        async with pool.acquire() as conn, conn.transaction():
            await OutboxWriter(conn, "svc", "test").add(
                "allocation.release_requested", _release_requested(fast_agg), aggregate_id=str(fast_agg)
            )
        await spy.wait_type("allocation.release_requested", allocation_id=fast_agg)
        await tx.commit()
        await slow.close()
        await spy.wait_type("allocation.release_requested", allocation_id=slow_agg)
    finally:
        relay.stop()
        await task
        await spy.stop()


class _RefusesOnce:
    """JetStream that fails the first publish of one aggregate's events (`aggregate`), or the first on one
    subject (`subject`), and passes everything else on."""

    def __init__(self, js, aggregate: uuid.UUID | None = None, *, subject: str | None = None) -> None:
        self.js, self.aggregate, self.subject, self.refused = js, str(aggregate), subject, 0

    def _refuses(self, subject: str, body: bytes) -> bool:
        if self.subject is not None:
            return subject == self.subject
        return json.loads(body)["payload"]["allocation_id"] == self.aggregate

    async def publish(self, subject: str, body: bytes, **kw):
        if not self.refused and self._refuses(subject, body):
            self.refused += 1
            raise nats.errors.TimeoutError
        return await self.js.publish(subject, body, **kw)


async def test_a_failed_publish_puts_its_rows_back_and_holds_only_its_aggregate(js, outbox_db, nats_server):
    dsn, pool = outbox_db
    stuck, other = uuid.uuid4(), uuid.uuid4()
    written: dict[str, list[str]] = {str(stuck): [], str(other): []}
    async with pool.acquire() as conn, conn.transaction():
        writer = OutboxWriter(conn, "svc", "test")
        for _ in range(3):
            for agg in (stuck, other):
                env = await writer.add("allocation.release_requested", _release_requested(agg), aggregate_id=str(agg))
                written[str(agg)].append(env.event_id)
    spy = await BusSpy(nats_server.url, "gpuaas.allocation.release_requested").start()
    flaky = _RefusesOnce(js, stuck)
    relay = OutboxRelay(dsn, "svc", flaky, poll_interval_s=0.2)  # type: ignore[arg-type]
    conn = await asyncpg.connect(dsn, server_settings={"search_path": "svc"})
    try:
        first = await relay.drain_once(conn)
        # The published rows are deleted by the next read, or when the relay stops or goes idle.
        assert await conn.fetchval("SELECT count(*) FROM svc.outbox") == 6
        await relay.forget_published(conn)
    finally:
        await conn.close()
    async with pool.acquire() as conn:
        left = await conn.fetch("SELECT event_id, attempts, last_error FROM outbox ORDER BY id")
    # The other aggregate went; the refused row and the later rows of its aggregate stayed, the refused one
    # with its attempt counted.
    assert first == (3, 1)
    assert [r["event_id"] for r in left] == written[str(stuck)]
    assert [r["attempts"] for r in left] == [1, 0, 0]
    assert "TimeoutError" in left[0]["last_error"]
    task = asyncio.create_task(relay.run())
    try:
        await spy.wait_for(lambda: len(spy.messages) >= 6, what="all six events")
        await eventually(lambda: _outbox_empty(pool))
    finally:
        relay.stop()
        await task
        await spy.stop()
    seen: dict[str, list[str]] = {}
    for _, data in spy.messages:
        seen.setdefault(data["payload"]["allocation_id"], []).append(data["event_id"])
    assert seen == written


async def test_an_aggregates_rows_keep_their_order_per_stream_and_a_failure_holds_only_its_stream(
    js, outbox_db, nats_server
):
    """An allocation's rows bound for two streams go out side by side; each stream still gets them in commit
    order, and a failed publish holds back only the later rows on its own stream."""
    dsn, pool = outbox_db
    agg = uuid.uuid4()
    unschedulable = m.PlacementUnschedulable(
        allocation_id=agg, reason_code="no_capacity", reason="test", free_gpus=0, requested_gpus=1
    )
    written: dict[str, list[str]] = {"ALLOCATIONS": [], "SCHEDULER": []}
    async with pool.acquire() as conn, conn.transaction():
        writer = OutboxWriter(conn, "svc", "test")
        for _ in range(2):
            env = await writer.add("allocation.release_requested", _release_requested(agg), aggregate_id=str(agg))
            written["ALLOCATIONS"].append(env.event_id)
            env = await writer.add("placement.unschedulable", unschedulable, aggregate_id=str(agg))
            written["SCHEDULER"].append(env.event_id)
    spy = await BusSpy(nats_server.url, "gpuaas.>").start()
    ours = {*written["ALLOCATIONS"], *written["SCHEDULER"]}
    flaky = _RefusesOnce(js, subject="gpuaas.allocation.release_requested")
    relay = OutboxRelay(dsn, "svc", flaky, poll_interval_s=0.2)  # type: ignore[arg-type]
    conn = await asyncpg.connect(dsn, server_settings={"search_path": "svc"})
    try:
        first = await relay.drain_once(conn)
        await relay.forget_published(conn)
        left = [r["event_id"] for r in await conn.fetch("SELECT event_id FROM svc.outbox ORDER BY id")]
    finally:
        await conn.close()
    # The other stream's rows went; on the refused stream the refused row and the one after it stayed.
    assert first == (2, 1)
    assert left == written["ALLOCATIONS"]
    task = asyncio.create_task(relay.run())
    try:
        await spy.wait_for(lambda: len([d for _, d in spy.messages if d["event_id"] in ours]) >= 4, what="all four")
        await eventually(lambda: _outbox_empty(pool))
    finally:
        relay.stop()
        await task
        await spy.stop()
    seen: dict[str, list[str]] = {"ALLOCATIONS": [], "SCHEDULER": []}
    for subject, data in spy.messages:
        if data["event_id"] in ours:
            seen["SCHEDULER" if subject.startswith("gpuaas.scheduler.") else "ALLOCATIONS"].append(data["event_id"])
    assert seen == written


async def _commit_one(pool, agg: uuid.UUID) -> str:
    """One transaction raising one event of `agg`: its NOTIFY carries the row."""
    async with pool.acquire() as conn, conn.transaction():
        env = await OutboxWriter(conn, "svc", "test").add(
            "allocation.release_requested", _release_requested(agg), aggregate_id=str(agg)
        )
    return env.event_id


def _by_aggregate(spy: BusSpy) -> dict[str, list[str]]:
    seen: dict[str, list[str]] = {}
    for _, data in spy.messages:
        seen.setdefault(data["payload"]["allocation_id"], []).append(data["event_id"])
    return seen


async def test_the_relay_publishes_what_notifications_carry_without_reading_the_table(
    js, outbox_db, writers, nats_server
):
    dsn, pool = outbox_db
    spy = await BusSpy(nats_server.url, "gpuaas.allocation.release_requested").start()
    relay = OutboxRelay(dsn, "svc", js, poll_interval_s=60.0, writers=writers)
    task = asyncio.create_task(relay.run())
    aggregates = [uuid.uuid4() for _ in range(3)]
    written: dict[str, list[str]] = {str(a): [] for a in aggregates}
    try:
        await eventually(lambda: relay.reads == 1, what="the read a new leader makes")
        for _ in range(5):
            for agg in aggregates:
                written[str(agg)].append(await _commit_one(pool, agg))
        await spy.wait_for(lambda: len(spy.messages) >= 15, what="fifteen relayed events")
        await eventually(lambda: _outbox_empty(pool), what="the published rows deleted")
        assert relay.reads == 1  # published from the notifications alone, deleted in batches
    finally:
        relay.stop()
        await task
        await spy.stop()
    assert _by_aggregate(spy) == written
    assert spy.violations == []


async def test_the_relay_publishes_nothing_a_notification_from_outside_its_pool_carries(
    js, outbox_db, writers, nats_server
):
    """A backend that is not a connection of the service's pool (here the superuser, in the service's own
    database) NOTIFYs the relay's channel with a row no commit wrote: the relay publishes no part of it, and only
    reads the table, where a genuine commit of the pool made meanwhile is found and published."""
    dsn, pool = outbox_db
    victim, genuine = uuid.uuid4(), uuid.uuid4()
    forged = EventCollector("allocator")
    env = await forged.add("allocation.release_requested", _release_requested(victim), aggregate_id=str(victim))
    payload = notice_payload(forged.pending, [env.model_dump_json()])
    spy = await BusSpy(nats_server.url, "gpuaas.allocation.release_requested").start()
    relay = OutboxRelay(dsn, "svc", js, poll_interval_s=60.0, writers=writers)
    task = asyncio.create_task(relay.run())
    outsider = await asyncpg.connect(dsn)
    try:
        await eventually(lambda: relay.reads == 1, what="the read a new leader makes")
        assert outsider.get_server_pid() not in writers and len(writers) > 0
        await outsider.execute("SELECT pg_notify($1, $2)", "gpuaas_outbox_svc", payload)
        await eventually(lambda: relay.foreign_notices == 1, what="the forged notification received")
        await eventually(lambda: relay.reads == 2, what="the table read it caused instead")
        ours = await _commit_one(pool, genuine)
        await spy.wait_for(lambda: any(d["event_id"] == ours for _, d in spy.messages), what="the genuine event")
        assert relay.reads == 2  # the pool's own notification is taken as it comes
    finally:
        await outsider.close()
        relay.stop()
        await task
        await spy.stop()
    assert _by_aggregate(spy) == {str(genuine): [ours]}


async def test_the_relay_takes_at_most_a_batch_of_notifications_at_a_time(js, outbox_db, nats_server):
    dsn, pool = outbox_db
    relay = OutboxRelay(dsn, "svc", js, batch_size=2)
    agg = uuid.uuid4()
    notices, ids = [], []
    for _ in range(5):
        events = EventCollector("test")
        env = await events.add("allocation.release_requested", _release_requested(agg), aggregate_id=str(agg))
        ids.append(env.event_id)
        notices.append(notice_payload(events.pending, [env.model_dump_json()]))
    spy = await BusSpy(nats_server.url, "gpuaas.allocation.release_requested").start()
    conn = await asyncpg.connect(dsn, server_settings={"search_path": "svc"})
    try:
        relay._notices = list(notices)
        assert await relay.relay_notices(conn) == (2, 0)
        assert relay._notices == notices[2:]  # the rest waits for the next turn, in order
        assert await relay.relay_notices(conn) == (2, 0)
        assert await relay.relay_notices(conn) == (1, 0)
        await spy.wait_for(lambda: len(spy.messages) >= 5, what="five relayed events")
    finally:
        await conn.close()
        await spy.stop()
    assert _by_aggregate(spy) == {str(agg): ids}


async def test_rows_too_big_for_a_notification_are_read_from_the_table(js, outbox_db, writers, nats_server):
    dsn, pool = outbox_db
    spy = await BusSpy(nats_server.url, "gpuaas.allocation.release_requested").start()
    relay = OutboxRelay(dsn, "svc", js, poll_interval_s=60.0, writers=writers)
    task = asyncio.create_task(relay.run())
    agg = uuid.uuid4()
    events = EventCollector("test")
    for i in range(30):  # 30 events of ~600 bytes in one commit: more than a NOTIFY may carry
        await events.add(
            "allocation.release_requested",
            m.AllocationReleaseRequested(allocation_id=agg, reason=f"{i}:" + "x" * 400),
            aggregate_id=str(agg),
        )
    statement = pending_statement("svc", events.pending)
    assert "pg_notify(E'gpuaas_outbox_svc', E'')" in statement  # nothing carried: too big
    try:
        await eventually(lambda: relay.reads == 1, what="the read a new leader makes")
        async with pool.acquire() as conn:
            await conn.execute(f"BEGIN; {statement}; COMMIT")
        await spy.wait_for(lambda: len(spy.messages) >= 30, what="thirty relayed events")
        assert relay.reads >= 2  # the empty notification sent the relay to the table
    finally:
        relay.stop()
        await task
        await spy.stop()
    assert _by_aggregate(spy) == {str(agg): [p.envelope.event_id for p in events.pending]}


async def test_a_failed_publish_of_a_notified_row_holds_its_aggregate_until_the_table_is_read(
    js, outbox_db, writers, nats_server
):
    dsn, pool = outbox_db
    stuck, other = uuid.uuid4(), uuid.uuid4()
    spy = await BusSpy(nats_server.url, "gpuaas.allocation.release_requested").start()
    flaky = _RefusesOnce(js, stuck)
    relay = OutboxRelay(dsn, "svc", flaky, poll_interval_s=60.0, writers=writers)  # type: ignore[arg-type]
    task = asyncio.create_task(relay.run())
    written: dict[str, list[str]] = {str(stuck): [], str(other): []}
    try:
        await eventually(lambda: relay.reads == 1, what="the read a new leader makes")
        for _ in range(3):
            for agg in (stuck, other):
                written[str(agg)].append(await _commit_one(pool, agg))
        await spy.wait_for(lambda: len(spy.messages) >= 6, what="all six events")
        await eventually(lambda: _outbox_empty(pool), what="the published rows deleted")
        assert flaky.refused == 1
        assert relay.reads >= 2  # after the failure the rows came from the table, in order
    finally:
        relay.stop()
        await task
        await spy.stop()
    assert _by_aggregate(spy) == written


async def test_republished_event_is_dropped_by_jetstream_dedup(js):
    env = Envelope.wrap(
        "allocation.release_requested",
        _release_requested(uuid.uuid4()).model_dump(mode="json"),
        producer="test",
        correlation_id="x",
    )
    body = env.model_dump_json().encode()
    first = await js.publish("gpuaas.allocation.release_requested", body, headers={"Nats-Msg-Id": env.event_id})
    second = await js.publish("gpuaas.allocation.release_requested", body, headers={"Nats-Msg-Id": env.event_id})
    assert not first.duplicate and second.duplicate and second.seq == first.seq


class _Probe:
    """A handler whose behaviour each test scripts by allocation id."""

    def __init__(self) -> None:
        self.effects: list[str] = []
        self.fail_times: dict[str, int] = {}
        self.attempts: dict[str, int] = {}
        self.stream_seqs: dict[str, list[int | None]] = {}
        self.done = asyncio.Event()

    async def handle(self, ctx: HandlerContext) -> None:
        alloc = str(ctx.payload.allocation_id)
        self.attempts[alloc] = self.attempts.get(alloc, 0) + 1
        self.stream_seqs.setdefault(alloc, []).append(ctx.stream_seq)
        if ctx.payload.reason == "permanent":
            raise PermanentError("schema_invalid", "scripted permanent failure")
        if self.attempts[alloc] <= self.fail_times.get(alloc, 0):
            raise RuntimeError("scripted transient failure")
        assert ctx.conn is not None
        await ctx.conn.execute("CREATE TABLE IF NOT EXISTS effects (alloc text)")
        await ctx.conn.execute("INSERT INTO effects VALUES ($1)", alloc)
        self.effects.append(alloc)
        self.done.set()


@pytest.fixture
async def probe_bus(js, outbox_db, nats_server):
    dsn, pool = outbox_db
    # Starts at the end of the stream so other tests' messages are not replayed.
    spec = await durable_at_end(js, "probe", "gpuaas.allocation.release_requested")
    durable = spec.durable
    bus_nc = await nats.connect(nats_server.url)
    bus = Bus(bus_nc, js, service="probe", schema="svc", pool=pool, retry_delays_s=(0.05,))
    probe = _Probe()
    bus.subscribe(spec, {"allocation.release_requested": probe.handle})
    await bus.start()
    dlq = await BusSpy(nats_server.url, f"gpuaas.dlq.{durable}").start()
    yield probe, pool, dlq
    await bus.stop()
    await bus_nc.close()
    await dlq.stop()


async def _publish(js, body: bytes, msg_id: str | None = None):
    headers = {"Nats-Msg-Id": msg_id} if msg_id else None
    return await js.publish("gpuaas.allocation.release_requested", body, headers=headers)


def _event(alloc: uuid.UUID, reason: str = "ok", event_id: str | None = None) -> tuple[str, bytes]:
    env = Envelope.wrap(
        "allocation.release_requested",
        m.AllocationReleaseRequested(allocation_id=alloc, reason=reason).model_dump(mode="json"),
        producer="test",
        correlation_id=str(alloc),
        event_id=event_id,
    )
    return env.event_id, env.model_dump_json().encode()


async def test_poison_messages_are_dead_lettered_and_the_consumer_keeps_going(probe_bus, js):
    probe, pool, dlq = probe_bus
    await _publish(js, b"{not json")
    await _publish(js, json.dumps({"type": "allocation.release_requested", "payload": {}}).encode())
    bad_payload = json.loads(_event(uuid.uuid4())[1])
    bad_payload["payload"]["allocation_id"] = "not-a-uuid"
    await _publish(js, json.dumps(bad_payload).encode())
    good = uuid.uuid4()
    await _publish(js, _event(good)[1])
    await dlq.wait_for(lambda: len(dlq.messages) >= 3, what="three dead letters")
    await asyncio.wait_for(probe.done.wait(), 10)
    reasons = sorted(d["payload"]["reason_code"] for _, d in dlq.messages)
    assert reasons == ["not_json", "schema_invalid", "schema_invalid"]
    assert all(d["payload"]["reason"] for _, d in dlq.messages)
    assert probe.effects == [str(good)]
    assert dlq.violations == []


@pytest.mark.parametrize(
    "poison",
    [
        lambda body: body.replace(b'"event_id":"', b'"event_id":"nul\\u0000', 1),
        lambda body: body.replace(b'"event_id":"', b'"event_id":"lone\\udc00', 1),
        lambda body: body.replace(b'"event_id":"', b'"event_id":"raw\xed\xa0\x80', 1),
        lambda body: body.replace(b'"reason":"', b'"reason":"\\ud800', 1),
    ],
    ids=["escaped-nul", "escaped-surrogate", "encoded-surrogate", "in-the-payload"],
)
async def test_a_string_postgres_cannot_store_is_dead_lettered_at_once(probe_bus, js, poison):
    # The event id reaches the inbox claim, where it would fail the same way on every delivery.
    probe, pool, dlq = probe_bus
    alloc = uuid.uuid4()
    _, body = _event(alloc)
    poisoned = poison(body)
    assert poisoned != body
    await _publish(js, poisoned)
    letter = await dlq.wait_type("dead_letter", timeout=10)
    assert letter["payload"]["reason_code"] == "schema_invalid"
    assert "Postgres cannot store" in letter["payload"]["reason"]
    assert letter["payload"]["num_delivered"] == 1
    assert str(alloc) not in probe.attempts
    good = uuid.uuid4()
    await _publish(js, _event(good)[1])
    await asyncio.wait_for(probe.done.wait(), 10)
    assert probe.effects == [str(good)]
    assert len(dlq.messages) == 1 and dlq.violations == []


async def test_transient_failures_are_retried_and_take_effect_once(probe_bus, js):
    probe, pool, dlq = probe_bus
    alloc = uuid.uuid4()
    probe.fail_times[str(alloc)] = 2
    ack = await _publish(js, _event(alloc)[1])
    await asyncio.wait_for(probe.done.wait(), 10)
    assert probe.attempts[str(alloc)] == 3
    # Each delivery names the message's place in its stream, by which another process can read it back.
    assert probe.stream_seqs[str(alloc)] == [ack.seq] * 3

    # The handler signals before its transaction commits; wait for the committed effect itself.
    async def committed() -> bool:
        exists = await pool.fetchval("SELECT to_regclass('svc.effects') IS NOT NULL")
        return exists and await pool.fetchval("SELECT count(*) FROM effects WHERE alloc = $1", str(alloc)) == 1

    await eventually(committed, timeout=10, what="the effect committed")


async def test_exhausted_retries_go_to_the_dead_letter_stream_with_the_reason(probe_bus, js):
    probe, pool, dlq = probe_bus
    alloc = uuid.uuid4()
    probe.fail_times[str(alloc)] = 99
    await _publish(js, _event(alloc)[1])
    letter = await dlq.wait_type("dead_letter", timeout=15)
    assert letter["payload"]["reason_code"] == "max_deliver"
    assert "scripted transient failure" in letter["payload"]["reason"]
    assert letter["payload"]["num_delivered"] == 3
    assert probe.attempts[str(alloc)] == 3


async def test_a_redelivered_event_has_no_second_effect(probe_bus, js):
    probe, pool, dlq = probe_bus
    alloc = uuid.uuid4()
    event_id, body = _event(alloc)
    # Two copies with different Nats-Msg-Ids get past JetStream dedup; the inbox must catch the second.
    await _publish(js, body, msg_id=f"{event_id}-a")
    await _publish(js, body, msg_id=f"{event_id}-b")
    second = uuid.uuid4()
    await _publish(js, _event(second)[1])
    await eventually(lambda: str(second) in probe.effects, timeout=10)
    assert probe.effects.count(str(alloc)) == 1
    assert probe.attempts[str(alloc)] == 1
    assert await pool.fetchval("SELECT count(*) FROM inbox WHERE message_id = $1", event_id) == 1


async def test_inbox_claims_once_per_consumer(outbox_db):
    _, pool = outbox_db
    event_id = derived_event_id("cause", "purpose")
    async with pool.acquire() as conn:
        assert await inbox.claim(conn, "consumer-a", event_id)
        assert not await inbox.claim(conn, "consumer-a", event_id)
        assert await inbox.claim(conn, "consumer-b", event_id)


async def _outbox_empty(pool) -> bool:
    return await pool.fetchval("SELECT count(*) FROM outbox") == 0


async def test_a_message_the_consumer_does_not_want_is_acknowledged_without_a_unit_of_work(js, outbox_db, nats_server):
    # `wanted` filters what a subject cannot: such a message opens no transaction (no inbox row), reaches no
    # handler and is not redelivered; the next wanted one is handled as usual.
    _, pool = outbox_db
    spec = await durable_at_end(js, "wanted", "gpuaas.allocation.release_requested")
    bus_nc = await nats.connect(nats_server.url)
    bus = Bus(bus_nc, js, service="wanted", schema="svc", pool=pool, retry_delays_s=(0.05,))
    probe = _Probe()
    bus.subscribe(
        spec, {"allocation.release_requested": probe.handle}, wanted=lambda payload: payload.reason != "not-mine"
    )
    await bus.start()
    try:
        skipped, wanted = uuid.uuid4(), uuid.uuid4()
        skipped_id, skipped_body = _event(skipped, reason="not-mine")
        await _publish(js, skipped_body)
        await _publish(js, _event(wanted)[1])
        await eventually(lambda: str(wanted) in probe.effects, timeout=10)
        assert str(skipped) not in probe.attempts
        assert await pool.fetchval("SELECT count(*) FROM inbox WHERE message_id = $1", skipped_id) == 0
        info = await js.consumer_info(spec.stream, spec.durable)
        assert info.num_ack_pending == 0 and info.num_redelivered == 0
    finally:
        await bus.stop()
        await bus_nc.close()
