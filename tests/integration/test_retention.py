"""Retention of inbox and Idempotency-Key rows on a real Postgres: old rows go in bounded batches, rows inside
the window stay and still make a redelivery a no-op, and two replicas never sweep one schema at once."""

from __future__ import annotations

import json

import asyncpg
import pytest

from gpuaas_common.db import create_pool
from gpuaas_common.migrations import apply_migrations
from gpuaas_common.retention import RetentionSweeper
from gpuaas_common.runtime import ServiceRuntime
from gpuaas_common.settings import ServiceSettings
from gpuaas_common.unit_of_work import UnitOfWork, no_repositories
from gpuaas_dev.testing.waiting import eventually

SCHEMA = "scheduler"  # has both an inbox and the admin API's admin_idempotency
DAY = 24 * 3600.0


@pytest.fixture
async def pool(fresh_db):
    conn = await asyncpg.connect(fresh_db)
    await apply_migrations(conn, SCHEMA, "gpuaas_scheduler.migrations")
    await conn.close()
    pool = await create_pool(fresh_db, SCHEMA)
    yield pool
    await pool.close()


async def _inbox_row(pool: asyncpg.Pool, message_id: str, age_s: float, consumer: str = "c") -> None:
    await pool.execute(
        "INSERT INTO inbox (consumer, message_id, received_at) VALUES ($1, $2, now() - make_interval(secs => $3))",
        consumer,
        message_id,
        age_s,
    )


async def _redelivered_is_noop(pool: asyncpg.Pool, message_id: str, consumer: str = "c") -> bool:
    async with UnitOfWork(pool, SCHEMA, "scheduler", no_repositories) as uow:
        seen = await uow.seen(consumer, message_id)
        await uow.commit()
    return seen


async def test_old_inbox_rows_go_in_batches_and_recent_ones_still_stop_redeliveries(pool):
    for i in range(7):
        await _inbox_row(pool, f"old-{i}", age_s=9 * DAY)
    await _inbox_row(pool, "recent", age_s=2 * DAY)
    await _inbox_row(pool, "just-now", age_s=0)

    sweeper = RetentionSweeper(pool, SCHEMA, inbox_retention_s=8 * DAY, idempotency_retention_s=8 * DAY, batch_size=3)
    deleted = await sweeper.sweep()

    assert deleted is not None and deleted["inbox"] == 7
    left = {r["message_id"] for r in await pool.fetch("SELECT message_id FROM inbox")}
    assert left == {"recent", "just-now"}
    # Inside the window a redelivery is still recognised; only a message past it would be taken as new.
    assert await _redelivered_is_noop(pool, "recent") is True
    assert await _redelivered_is_noop(pool, "just-now") is True
    assert await _redelivered_is_noop(pool, "old-0") is False
    assert await sweeper.sweep() == {"inbox": 0, "admin_idempotency": 0}


async def test_stored_idempotency_answers_expire_on_their_own_setting(pool):
    for key, age_s in (("old", 3 * DAY), ("recent", 60.0)):
        await pool.execute(
            "INSERT INTO admin_idempotency (key, method, path, request_hash, status_code, response, created_at) "
            "VALUES ($1, 'POST', '/x', 'h', 200, $2::jsonb, now() - make_interval(secs => $3))",
            key,
            json.dumps({}),
            age_s,
        )
    await _inbox_row(pool, "three-days", age_s=3 * DAY)

    deleted = await RetentionSweeper(pool, SCHEMA, inbox_retention_s=8 * DAY, idempotency_retention_s=DAY).sweep()

    assert deleted == {"inbox": 0, "admin_idempotency": 1}
    assert [r["key"] for r in await pool.fetch("SELECT key FROM admin_idempotency")] == ["recent"]


async def test_a_schema_without_the_admin_api_sweeps_its_inbox_only(fresh_db):
    conn = await asyncpg.connect(fresh_db)
    await apply_migrations(conn, "allocator", "gpuaas_allocator.migrations")
    await conn.close()
    pool = await create_pool(fresh_db, "allocator")
    try:
        await _inbox_row(pool, "old", age_s=9 * DAY)
        deleted = await RetentionSweeper(
            pool, "allocator", inbox_retention_s=8 * DAY, idempotency_retention_s=8 * DAY
        ).sweep()
        assert deleted == {"inbox": 1}
    finally:
        await pool.close()


async def test_only_one_replica_sweeps_a_schema_at_a_time(pool, fresh_db):
    await _inbox_row(pool, "old", age_s=9 * DAY)
    holder = await asyncpg.connect(fresh_db)
    try:
        # Another replica in the middle of its sweep holds the schema's lock.
        await holder.execute("SELECT pg_advisory_lock(hashtext($1))", f"gpuaas-retention:{SCHEMA}")
        sweeper = RetentionSweeper(pool, SCHEMA, inbox_retention_s=8 * DAY, idempotency_retention_s=8 * DAY)
        assert await sweeper.sweep() is None
        assert await pool.fetchval("SELECT count(*) FROM inbox") == 1
        await holder.execute("SELECT pg_advisory_unlock(hashtext($1))", f"gpuaas-retention:{SCHEMA}")
        assert await sweeper.sweep() == {"inbox": 1, "admin_idempotency": 0}
    finally:
        await holder.close()


def test_retention_cannot_be_set_inside_the_duplicate_window(monkeypatch):
    monkeypatch.setenv("GPUAAS_INBOX_RETENTION_S", "60")
    with pytest.raises(ValueError):
        ServiceSettings()
    monkeypatch.setenv("GPUAAS_INBOX_RETENTION_S", str(2 * DAY))
    assert ServiceSettings().inbox_retention_s == 2 * DAY
    assert ServiceSettings.model_fields["inbox_retention_s"].default > 7 * DAY  # longer than streams keep messages


async def test_every_postgres_backed_service_runtime_sweeps_its_schema(fresh_db, nats_server):
    conn = await asyncpg.connect(fresh_db)
    await apply_migrations(conn, "allocator", "gpuaas_allocator.migrations")
    await conn.execute(
        "INSERT INTO allocator.inbox (consumer, message_id, received_at) VALUES "
        "('c', 'old', now() - interval '9 days'), ('c', 'recent', now())"
    )
    settings = ServiceSettings(database_url=fresh_db, nats_url=nats_server.url, health_port=0)
    rt = ServiceRuntime("allocator", settings, schema="allocator", migrations_package="gpuaas_allocator.migrations")
    await rt.setup()
    try:
        await rt.start()
        await eventually(
            lambda: conn.fetchval("SELECT count(*) = 1 FROM allocator.inbox"),
            timeout=30,
            what="the runtime's retention sweep",
        )
        assert await conn.fetchval("SELECT message_id FROM allocator.inbox") == "recent"
    finally:
        await rt.stop()
        await conn.close()
