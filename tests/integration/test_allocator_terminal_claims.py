"""The terminal's session claims in Postgres (migration 010, review 3 N7): one live session per allocation and a
cap per tenant whichever replica opens them, and a replica that died never locks a console: its stale claim is
ended `replica_gone` by the next open. Real Postgres, the allocator's own handlers and hub."""

from __future__ import annotations

import uuid

import asyncpg
import pytest

from gpuaas_allocator.adapters.repository import AllocationRepository
from gpuaas_allocator.service_layer.terminal import Refused, TerminalHub, TerminalLimits
from gpuaas_common.db import create_pool
from gpuaas_common.migrations import apply_migrations
from gpuaas_common.unit_of_work import UnitOfWork
from tests.e2e.test_slice_terminal import SLICE, TENANT, _allocation


@pytest.fixture
async def pool(fresh_db: str):
    conn = await asyncpg.connect(fresh_db)
    await apply_migrations(conn, "allocator", "gpuaas_allocator.migrations")
    await conn.close()
    p = await create_pool(fresh_db, "allocator", min_size=1, max_size=2)
    async with UnitOfWork(p, "allocator", "allocator", AllocationRepository) as uow:
        await uow.repos.upsert_image(SLICE)
        await uow.commit()
    yield p
    await p.close()


def _replica(pool: asyncpg.Pool, **limits: object) -> TerminalHub:
    return TerminalHub(
        lambda: UnitOfWork(pool, "allocator", "allocator", AllocationRepository),
        session_max_s=60,
        input_hold_s=1,
        limits=TerminalLimits(**limits),  # type: ignore[arg-type]
    )


async def test_one_live_session_per_allocation_and_a_tenant_cap_across_replicas(pool: asyncpg.Pool) -> None:
    a, b = _replica(pool, per_tenant=2), _replica(pool, per_tenant=2)
    first, second, third = [await _allocation(pool, TENANT, active=True) for _ in range(3)]
    await pool.execute("DELETE FROM outbox")  # the allocations' own messages: only the terminal's are counted
    opened = await a.open(first, TENANT, "user:alice")
    with pytest.raises(Refused) as exc:
        await b.open(first, TENANT, "user:bob")  # the other replica: the claim is in Postgres, not in a's memory
    assert (exc.value.refusal.status, exc.value.refusal.code) == (409, "terminal_in_use")
    await b.open(second, TENANT, "user:bob")
    with pytest.raises(Refused) as exc:
        await a.open(third, TENANT, "user:alice")
    assert (exc.value.refusal.status, exc.value.refusal.code) == (429, "too_many_terminals")
    assert await pool.fetchval("SELECT count(*) FROM terminal_sessions") == 2
    assert await pool.fetchval("SELECT count(*) FROM outbox") == 2  # the two open tasks, nothing for the refused
    await a.close(opened, "client_closed")
    await a.open(third, TENANT, "user:alice")  # the closed one no longer counts
    replicas = await pool.fetch("SELECT DISTINCT replica_id FROM terminal_sessions")
    assert {r["replica_id"] for r in replicas} == {a.replica_id, b.replica_id}


async def test_a_dead_replicas_stale_claim_is_ended_by_the_next_open(pool: asyncpg.Pool) -> None:
    dead, alive = _replica(pool, claim_stale_s=30), _replica(pool, claim_stale_s=30)
    alloc = await _allocation(pool, TENANT, active=True)
    held = await dead.open(alloc, TENANT, "user:alice")
    await alive.renew_claims()  # renews only its own (none): the dead one's claim ages
    await pool.execute("UPDATE terminal_sessions SET seen_at = now() - interval '31 seconds'")
    session = await alive.open(alloc, TENANT, "user:alice")
    rows = {r["session_id"]: r for r in await pool.fetch("SELECT * FROM terminal_sessions")}
    assert rows[held.session_id]["end_reason"] == "replica_gone" and rows[held.session_id]["ended_at"]
    assert rows[session.session_id]["ended_at"] is None and rows[session.session_id]["replica_id"] == alive.replica_id
    # A live replica's renewal keeps its claim: nothing is taken from it.
    await alive.renew_claims()
    with pytest.raises(Refused):
        await dead.open(alloc, TENANT, "user:bob")
    assert uuid.UUID(str(session.session_id)) in alive.sessions
