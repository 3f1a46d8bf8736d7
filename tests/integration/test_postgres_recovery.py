"""Postgres as the services meet it: durable by default, reached through a DSN that may name several servers,
and a pool that carries on after the server restarted."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import asyncpg
import nats
import pytest

from gpuaas_allocator.settings import AllocatorSettings
from gpuaas_common.contract import messages as m
from gpuaas_common.db import create_pool
from gpuaas_common.jetstream import provision
from gpuaas_common.migrations import apply_migrations
from gpuaas_common.outbox import OutboxRelay, OutboxWriter
from gpuaas_common.pg_roles import role_dsn
from gpuaas_common.settings import ServiceSettings
from gpuaas_common.unit_of_work import UnitOfWork, no_repositories
from gpuaas_dev.testing.bus_spy import BusSpy
from gpuaas_dev.testing.servers import PostgresServer, free_port
from gpuaas_image_pipeline.settings import ImagePipelineSettings
from gpuaas_maas_gateway.settings import GatewaySettings
from gpuaas_node_agent.settings import AgentSettings
from gpuaas_scheduler.settings import SchedulerSettings

SCHEMA = "probe"


@pytest.fixture(scope="module")
def durable_pg(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PostgresServer]:
    """A server of this module's own (it is restarted), started with the defaults the dev stack uses."""
    server = PostgresServer(Path(tmp_path_factory.mktemp("durable-pg"))).start()
    yield server
    server.stop()


@pytest.fixture
async def probe_dsn(durable_pg: PostgresServer) -> AsyncIterator[str]:
    conn = await asyncpg.connect(durable_pg.dsn)
    await apply_migrations(conn, SCHEMA, None)
    await conn.execute(f"CREATE TABLE IF NOT EXISTS {SCHEMA}.effects (id uuid PRIMARY KEY)")
    await conn.close()
    yield durable_pg.dsn


async def _settings(conn: asyncpg.Connection) -> dict[str, str]:
    return {k: await conn.fetchval(f"SHOW {k}") for k in ("fsync", "synchronous_commit", "full_page_writes")}


async def _one_unit_of_work(pool: asyncpg.Pool) -> uuid.UUID:
    """What a handler does: a transaction with an inbox row and an effect, committed."""
    effect = uuid.uuid4()
    async with UnitOfWork(pool, SCHEMA, "probe", no_repositories) as uow:
        assert not await uow.seen("probe-consumer", str(effect))
        await uow.conn.execute("INSERT INTO effects VALUES ($1)", effect)
        await uow.commit()
    return effect


async def test_the_default_postgres_is_durable_and_the_test_one_says_it_is_not(durable_pg, postgres_server) -> None:
    assert durable_pg.durable and not postgres_server.durable
    conn = await asyncpg.connect(durable_pg.dsn)
    try:
        assert await _settings(conn) == {"fsync": "on", "synchronous_commit": "on", "full_page_writes": "on"}
    finally:
        await conn.close()
    conn = await asyncpg.connect(postgres_server.dsn)
    try:
        assert await _settings(conn) == {"fsync": "off", "synchronous_commit": "off", "full_page_writes": "off"}
    finally:
        await conn.close()


async def test_a_committed_unit_of_work_survives_an_immediate_restart(durable_pg, probe_dsn) -> None:
    pool = await create_pool(probe_dsn, SCHEMA)
    try:
        effect = await _one_unit_of_work(pool)
    finally:
        await pool.close()
    durable_pg.restart("immediate")  # no shutdown checkpoint: the commit lives only in the WAL
    conn = await asyncpg.connect(probe_dsn)
    try:
        assert await conn.fetchval(f"SELECT count(*) FROM {SCHEMA}.effects WHERE id = $1", effect) == 1
    finally:
        await conn.close()


@pytest.mark.parametrize("mode", ["fast", "immediate"])
async def test_the_service_pool_carries_on_after_a_postgres_restart(durable_pg, probe_dsn, mode) -> None:
    pool = await create_pool(probe_dsn, SCHEMA, min_size=2, max_size=4)
    try:
        await _one_unit_of_work(pool)
        durable_pg.restart(mode)
        # The pool's connections died with the server; the next unit of work must not.
        effect = await _one_unit_of_work(pool)
        assert await pool.fetchval("SELECT count(*) FROM effects WHERE id = $1", effect) == 1
    finally:
        await pool.close()


async def test_a_restart_can_turn_synchronous_commit_off_and_on_again(durable_pg, probe_dsn) -> None:
    """The chaos run's way to lose the last commits on purpose: the server comes back with synchronous_commit
    off (and says it is no longer durable), and a later restart makes it durable again."""
    try:
        durable_pg.restart("fast", synchronous_commit=False)
        assert not durable_pg.durable
        conn = await asyncpg.connect(probe_dsn)
        try:
            assert await _settings(conn) == {"fsync": "on", "synchronous_commit": "off", "full_page_writes": "on"}
        finally:
            await conn.close()
    finally:
        durable_pg.restart("immediate", synchronous_commit=True)
    assert durable_pg.durable
    conn = await asyncpg.connect(probe_dsn)
    try:
        assert await _settings(conn) == {"fsync": "on", "synchronous_commit": "on", "full_page_writes": "on"}
    finally:
        await conn.close()


@pytest.mark.parametrize("mode", ["fast", "immediate"])
async def test_the_outbox_relay_carries_on_after_a_postgres_restart(durable_pg, probe_dsn, nats_server, mode) -> None:
    """Its connections (and the advisory lock one of them held) die with the server: the relay connects again,
    leads again and relays what is written afterwards, instead of dying and taking its service with it."""
    nc = await nats.connect(nats_server.url)
    js = nc.jetstream()
    await provision(js)
    spy = await BusSpy(nats_server.url, "gpuaas.allocation.release_requested").start()
    relay = OutboxRelay(probe_dsn, SCHEMA, js, poll_interval_s=0.2)
    task = asyncio.create_task(relay.run())

    async def relayed() -> str:
        alloc = uuid.uuid4()
        conn = await asyncpg.connect(probe_dsn, server_settings={"search_path": SCHEMA})
        async with conn.transaction():
            await OutboxWriter(conn, SCHEMA, "test").add(
                "allocation.release_requested",
                m.AllocationReleaseRequested(allocation_id=alloc),
                aggregate_id=str(alloc),
            )
        await conn.close()
        found = await spy.wait_type("allocation.release_requested", timeout=30, allocation_id=alloc)
        return str(found["payload"]["allocation_id"])

    try:
        await relayed()
        durable_pg.restart(mode)
        await relayed()
        assert not task.done()
    finally:
        relay.stop()
        await asyncio.wait_for(task, 10)
        await spy.stop()
        await nc.drain()
    assert spy.violations == []


def _multi_host(dsn: str, dead_port: int) -> str:
    """The DSN with a server that is down listed first: the client must move on to the live one."""
    scheme, rest = dsn.split("://", 1)
    creds, tail = rest.rsplit("@", 1)
    hosts, path = tail.split("/", 1)
    return f"{scheme}://{creds}@127.0.0.1:{dead_port},{hosts}/{path}?target_session_attrs=read-write"


async def test_a_dsn_with_several_hosts_is_accepted_by_every_service_and_its_pool(durable_pg, probe_dsn) -> None:
    dsn = _multi_host(probe_dsn, free_port())
    for settings in (
        ServiceSettings,
        AllocatorSettings,
        SchedulerSettings,
        ImagePipelineSettings,
        GatewaySettings,
        AgentSettings,
    ):
        assert settings(database_url=dsn).database_url.get_secret_value() == dsn  # type: ignore[call-arg]
    # Per-service role DSNs keep every host and the query.
    derived = role_dsn(dsn, "gpuaas", "svc_role", "pw")
    assert derived.split("@", 1)[1] == dsn.split("@", 1)[1].replace(dsn.rsplit("/", 1)[1].split("?")[0], "gpuaas")

    pool = await create_pool(dsn, SCHEMA)
    try:
        effect = await _one_unit_of_work(pool)
        assert await pool.fetchval("SELECT count(*) FROM effects WHERE id = $1", effect) == 1
        assert await pool.fetchval("SELECT pg_is_in_recovery()") is False
        durable_pg.restart("fast")
        await _one_unit_of_work(pool)
    finally:
        await pool.close()


def test_a_dsn_with_a_bad_port_is_refused_without_echoing_the_password() -> None:
    with pytest.raises(ValueError) as err:
        ServiceSettings(database_url="postgresql://u:s3cret-pw@h1:5432,h2:54x2/db")  # type: ignore[arg-type]
    assert "h2:54x2" in str(err.value) and "s3cret-pw" not in str(err.value)
