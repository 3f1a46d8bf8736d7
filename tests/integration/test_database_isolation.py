"""One database per service, against a real cluster: another service's role cannot reach the allocator's outbox
relay. Postgres checks no privilege on NOTIFY, LISTEN or advisory locks; they are scoped to a database, and
CONNECT is the privilege that keeps the other roles out of the allocator's (issue 24, point 1).

Where these tests need a notification *not* to arrive, they rely on the order Postgres keeps: notifications go
through one queue for the whole cluster in commit order, and a listener reads that queue in order, so once a
later notification has arrived, an earlier one for the same listener would have arrived first.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import asyncpg
import pytest

from gpuaas_common.contract import messages as m
from gpuaas_common.db import BackendPids, create_pool
from gpuaas_common.migrations import apply_migrations
from gpuaas_common.outbox import EventCollector, OutboxRelay, OutboxWriter, notice_payload, notify_channel
from gpuaas_common.pg_roles import SERVICE_ROLES, ensure_service_roles, role_dsn, service_database, with_database
from gpuaas_dev.testing.bus_spy import BusSpy
from gpuaas_dev.testing.waiting import eventually

SUBJECT = "gpuaas.allocation.release_requested"


@pytest.fixture
async def deployment(postgres_server) -> AsyncIterator[tuple[str, dict[str, str], dict[str, str]]]:
    """A deployment's databases and roles (prefix, service -> DSN, service -> password); dropped afterwards."""
    prefix = f"iso_{uuid.uuid4().hex[:10]}"
    passwords = {service: uuid.uuid4().hex for service in SERVICE_ROLES}
    dsns = await ensure_service_roles(postgres_server.dsn, prefix, passwords)
    conn = await asyncpg.connect(dsns["allocator"])
    try:
        await apply_migrations(conn, "allocator", "gpuaas_allocator.migrations")
    finally:
        await conn.close()
    yield prefix, dsns, passwords
    admin = await asyncpg.connect(postgres_server.dsn)
    try:
        for service in SERVICE_ROLES:
            await admin.execute(f'DROP DATABASE IF EXISTS "{service_database(prefix, service)}" WITH (FORCE)')
    finally:
        await admin.close()


@pytest.fixture
async def allocator_relay(deployment, js) -> AsyncIterator[tuple[OutboxRelay, asyncpg.Pool]]:
    """The allocator's relay and pool as its runtime wires them: the relay takes rows from the pool's backends."""
    _, dsns, _ = deployment
    writers = BackendPids()
    pool = await create_pool(dsns["allocator"], "allocator", min_size=1, max_size=2, writers=writers)
    relay = OutboxRelay(dsns["allocator"], "allocator", js, poll_interval_s=60.0, writers=writers)
    task = asyncio.create_task(relay.run())
    try:
        await eventually(lambda: relay.reads == 1, what="the allocator relay leading")
        yield relay, pool
    finally:
        relay.stop()
        await task
        await pool.close()


async def _forged(victim: uuid.UUID) -> tuple[str, str]:
    events = EventCollector("allocator")
    env = await events.add(
        "allocation.release_requested",
        m.AllocationReleaseRequested(allocation_id=victim, reason="forged"),
        aggregate_id=str(victim),
    )
    return env.event_id, notice_payload(events.pending, [env.model_dump_json()])


async def _commit_genuine(pool: asyncpg.Pool, alloc: uuid.UUID) -> str:
    async with pool.acquire() as conn, conn.transaction():
        env = await OutboxWriter(conn, "allocator", "allocator").add(
            "allocation.release_requested",
            m.AllocationReleaseRequested(allocation_id=alloc, reason="genuine"),
            aggregate_id=str(alloc),
        )
    return env.event_id


async def test_another_services_role_cannot_make_the_allocator_relay_publish(deployment, allocator_relay, nats_server):
    """The review's W1 exploit with the scheduler's credentials: its NOTIFY on the allocator relay's channel is
    published by nobody, and it cannot even connect to the allocator's database to send it there."""
    prefix, dsns, passwords = deployment
    relay, pool = allocator_relay
    victim, genuine = uuid.uuid4(), uuid.uuid4()
    forged_id, payload = await _forged(victim)
    scheduler_in_allocator_db = role_dsn(
        dsns["scheduler"],
        service_database(prefix, "allocator"),
        SERVICE_ROLES["scheduler"].role,
        passwords["scheduler"],
    )
    with pytest.raises(asyncpg.InsufficientPrivilegeError):
        await asyncpg.connect(scheduler_in_allocator_db)
    spy = await BusSpy(nats_server.url, SUBJECT).start()
    scheduler = await asyncpg.connect(dsns["scheduler"])
    try:
        await scheduler.execute("SELECT pg_notify($1, $2)", notify_channel("allocator"), payload)
        ours = await _commit_genuine(pool, genuine)  # committed after the forgery: it arrives after it
        await spy.wait_for(lambda: any(d["event_id"] == ours for _, d in spy.messages), what="the genuine event")
    finally:
        await scheduler.close()
        await spy.stop()
    assert forged_id not in {d["event_id"] for _, d in spy.messages}
    assert relay.foreign_notices == 0  # the forgery never reached the relay: the first wall alone held


async def test_another_services_role_cannot_listen_to_the_allocators_events(deployment, allocator_relay):
    _, dsns, _ = deployment
    _, pool = allocator_relay
    heard: list[str] = []
    marker = asyncio.Event()
    scheduler = await asyncpg.connect(dsns["scheduler"])
    try:
        await scheduler.add_listener(notify_channel("allocator"), lambda *args: heard.append(args[3]))
        await scheduler.add_listener("iso_marker", lambda *_args: marker.set())
        await _commit_genuine(pool, uuid.uuid4())
        await scheduler.execute("NOTIFY iso_marker")  # after the allocator's commit in the cluster's one queue
        await asyncio.wait_for(marker.wait(), timeout=30)
    finally:
        await scheduler.close()
    assert heard == []


async def test_another_services_role_cannot_stall_the_allocator_relay_with_its_lock(deployment, js):
    """The relay's advisory lock taken by the scheduler's role is the scheduler's database's lock: the allocator's
    relay still becomes leader."""
    _, dsns, _ = deployment
    scheduler = await asyncpg.connect(dsns["scheduler"])
    try:
        assert await scheduler.fetchval("SELECT pg_try_advisory_lock(hashtext($1))", "gpuaas-relay:allocator")
        relay = OutboxRelay(dsns["allocator"], "allocator", js, poll_interval_s=0.1)
        task = asyncio.create_task(relay.run())
        try:
            await eventually(lambda: relay.reads >= 1, timeout=10, what="the allocator relay leading")
        finally:
            relay.stop()
            await task
    finally:
        await scheduler.close()


async def test_the_superuser_still_reaches_each_service_database(postgres_server, deployment):
    """Tests and ops read a service's tables through the superuser on that service's database."""
    prefix, _, _ = deployment
    conn = await asyncpg.connect(with_database(postgres_server.dsn, service_database(prefix, "allocator")))
    try:
        assert await conn.fetchval("SELECT count(*) FROM allocator.outbox") == 0
    finally:
        await conn.close()
