"""The migrations runner against a real Postgres: idempotent, concurrent-safe, one schema per service."""

from __future__ import annotations

import asyncio
import uuid

import asyncpg
import pytest

from gpuaas_common.migrations import apply_migrations


async def test_services_get_their_own_schema_and_reapplying_is_a_noop(fresh_db):
    conn = await asyncpg.connect(fresh_db)
    try:
        first = await apply_migrations(conn, "allocator", "gpuaas_allocator.migrations")
        assert first[0] == "000_outbox_inbox" and "001_allocations" in first
        assert await apply_migrations(conn, "allocator", "gpuaas_allocator.migrations") == []
        await apply_migrations(conn, "scheduler", "gpuaas_scheduler.migrations")
        tables = await conn.fetch(
            "SELECT table_schema, table_name FROM information_schema.tables "
            "WHERE table_name IN ('outbox', 'allocations', 'nodes') ORDER BY 1, 2"
        )
        assert [(r["table_schema"], r["table_name"]) for r in tables] == [
            ("allocator", "allocations"),
            ("allocator", "outbox"),
            ("scheduler", "nodes"),
            ("scheduler", "outbox"),
        ]
    finally:
        await conn.close()


async def test_two_replicas_starting_together_apply_each_migration_once(fresh_db):
    conns = [await asyncpg.connect(fresh_db) for _ in range(3)]
    try:
        results = await asyncio.gather(
            *(apply_migrations(c, "image_pipeline", "gpuaas_image_pipeline.migrations") for c in conns)
        )
        applied = [v for r in results for v in r]
        assert sorted(applied) == sorted(set(applied))
        assert await conns[0].fetchval("SELECT count(*) FROM image_pipeline.schema_migrations") == len(applied)
    finally:
        for c in conns:
            await c.close()


async def test_invalid_schema_names_are_refused(fresh_db):
    conn = await asyncpg.connect(fresh_db)
    try:
        with pytest.raises(ValueError):
            await apply_migrations(conn, 'x"; DROP TABLE y; --', None)
    finally:
        await conn.close()


async def test_a_claim_is_held_or_released_never_in_doubt(fresh_db):
    from gpuaas_scheduler.adapters import synthetic

    conn = await asyncpg.connect(fresh_db, server_settings={"search_path": "scheduler"})
    try:
        await apply_migrations(conn, "scheduler", "gpuaas_scheduler.migrations")
        (node_id, *_) = await synthetic.build(conn, slice_hosts=0, baremetal_hosts=1)
        insert = (
            "INSERT INTO allocation_resource_claims (allocation_id, node_id, claim_kind, status, fencing_epoch) "
            "VALUES ($1, $2, 'node_exclusive', $3, 1)"
        )
        with pytest.raises(asyncpg.CheckViolationError):
            await conn.execute(insert, uuid.uuid4(), node_id, "in_doubt")
        await conn.execute(insert, uuid.uuid4(), node_id, "held")
    finally:
        await conn.close()
