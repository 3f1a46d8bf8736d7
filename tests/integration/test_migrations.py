"""The migrations runner against a real Postgres: idempotent, concurrent-safe, one schema per service."""

from __future__ import annotations

import asyncio
import uuid

import asyncpg
import pytest

from gpuaas_common import inbox
from gpuaas_common.inbox import HostInbox
from gpuaas_common.migrations import COMMON_MIGRATIONS, apply_migrations


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


async def test_the_inbox_gains_its_node_under_the_rows_already_there(fresh_db):
    """000_inbox_node on a deployment from before it: the rows its inbox holds stay, naming no node (no host's
    group, so no trim takes them), and a host-fed claim works at once."""
    conn = await asyncpg.connect(fresh_db)
    try:
        await conn.execute("CREATE SCHEMA upgraded")
        await conn.execute(
            "CREATE TABLE upgraded.schema_migrations (version text PRIMARY KEY, applied_at timestamptz DEFAULT now())"
        )
        async with conn.transaction():
            await conn.execute("SET LOCAL search_path TO upgraded")
            for version, sql in COMMON_MIGRATIONS:
                if version != "000_inbox_node":
                    await conn.execute(sql)
                    await conn.execute("INSERT INTO schema_migrations (version) VALUES ($1)", version)
            await conn.execute("INSERT INTO inbox (consumer, message_id) VALUES ('c', 'old-1'), ('c', 'old-2')")
        assert await apply_migrations(conn, "upgraded", None) == ["000_inbox_node"]
        await conn.execute("SET search_path TO upgraded")
        assert await inbox.claim(conn, "c", "new", HostInbox("n1", 1))
        rows = await conn.fetch("SELECT message_id, node_id FROM inbox ORDER BY message_id")
        assert [tuple(r) for r in rows] == [("new", "n1"), ("old-1", None), ("old-2", None)]
    finally:
        await conn.close()


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
