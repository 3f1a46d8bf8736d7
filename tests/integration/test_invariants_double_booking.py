"""The independent checker's history check: two claims whose lifetimes overlap on one slot, one device two
slots share (GPU, disk, fabric VF) or one node (a whole-node claim beside a slot claim) are reported; claims
one after the other are not. The rows are written directly: the checker must catch what the scheduler's own
unique indexes would not."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta

import asyncpg

from gpuaas_dev.testing.invariants import double_booking

from .scheduler_db import scheduler_pool

T0 = datetime(2026, 1, 1, tzinfo=UTC)


async def _node(conn: asyncpg.Connection, node: str) -> None:
    await conn.execute(
        "INSERT INTO nodes (node_id, kind, hostname, region, pool, sku, profile_intent) "
        "VALUES ($1, 'slice_host', $1, 'r', 'p', 'h200', 'slice-vm')",
        node,
    )


async def _slot(conn: asyncpg.Connection, slot: str, node: str, gpu: str, disk: str, vf: str) -> None:
    await conn.execute(
        "INSERT INTO node_resource_slots (slot_id, node_id, gpu_pci_address, nvme_by_id, fabric_vf_pci_address, "
        "profile, status) VALUES ($1, $2, $3, $4, $5, 'slice-vm', 'available')",
        slot,
        node,
        gpu,
        disk,
        vf,
    )


async def _claim(conn: asyncpg.Connection, node: str, slot: str | None, start: int, end: int | None) -> str:
    alloc = uuid.uuid4()
    await conn.execute(
        "INSERT INTO allocation_resource_claims (allocation_id, node_id, slot_id, claim_kind, status, fencing_epoch, "
        "created_at, released_at) VALUES ($1, $2, $3, $4, $5, 1, $6, $7)",
        alloc,
        node,
        slot,
        "slot" if slot else "node_exclusive",
        "held" if end is None else "released",
        T0 + timedelta(seconds=start),
        None if end is None else T0 + timedelta(seconds=end),
    )
    return str(alloc)


async def test_overlapping_claims_on_a_shared_device_or_beside_a_whole_node_claim_are_reported(fresh_db) -> None:
    async with scheduler_pool(fresh_db) as pool, pool.acquire() as conn:
        await _node(conn, "n1")
        await _node(conn, "n2")
        # s2 shares s1's disk; s3 shares nothing.
        await _slot(conn, "s1", "n1", "0000:18:00.0", "nvme-a", "0000:19:00.1")
        await _slot(conn, "s2", "n1", "0000:2a:00.0", "nvme-a", "0000:2b:00.1")
        await _slot(conn, "s3", "n2", "0000:18:00.0", "nvme-c", "0000:19:00.1")
        disk_first = await _claim(conn, "n1", "s1", 0, 100)
        disk_second = await _claim(conn, "n1", "s2", 50, 150)
        # n2: a slot claim, then a whole-node claim that starts before it ended, then one after.
        slot_claim = await _claim(conn, "n2", "s3", 0, 60)
        whole = await _claim(conn, "n2", None, 30, 40)
        await _claim(conn, "n2", None, 70, None)
        found = await double_booking(conn)
    assert sorted(found) == sorted(
        [
            f"disk nvme-a on n1 was held by {disk_first} and {disk_second} at the same time",
            f"node on n2 was held by {slot_claim} and {whole} at the same time",
        ]
    )


async def test_claims_one_after_the_other_are_no_double_booking(fresh_db) -> None:
    async with scheduler_pool(fresh_db) as pool, pool.acquire() as conn:
        await _node(conn, "n1")
        await _slot(conn, "s1", "n1", "0000:18:00.0", "nvme-a", "0000:19:00.1")
        await _slot(conn, "s2", "n1", "0000:2a:00.0", "nvme-a", "0000:2b:00.1")
        await _claim(conn, "n1", "s1", 0, 100)
        await _claim(conn, "n1", "s2", 100, 150)  # the disk changes hands the moment the first claim ends
        await _claim(conn, "n1", "s1", 150, None)
        await _claim(conn, "n1", None, 0, 0)  # an empty span overlaps nothing
        assert await double_booking(conn) == []


async def test_a_claim_taken_right_after_a_release_is_stamped_after_it(fresh_db) -> None:
    """The scheduler's own timestamps: a placement whose transaction began before another allocation's
    release committed used to be stamped with its transaction's start (now()), before that release, and the
    history read as an overlap (chaos run, seed 1). The stamps are the moments of the insert and the release."""
    from gpuaas_scheduler.adapters.inventory.slot_transitions import release_claims

    async with scheduler_pool(fresh_db) as pool:
        async with pool.acquire() as conn:
            await _node(conn, "n1")
            await _slot(conn, "s1", "n1", "0000:18:00.0", "nvme-a", "0000:19:00.1")
            first = uuid.uuid4()
            await conn.execute(
                "INSERT INTO allocation_resource_claims (allocation_id, node_id, slot_id, claim_kind, status, "
                "fencing_epoch) VALUES ($1, 'n1', 's1', 'slot', 'held', 1)",
                first,
            )
        async with pool.acquire() as placing, pool.acquire() as releasing:
            tx = placing.transaction()
            await tx.start()
            await placing.fetchval("SELECT now()")  # the placement's transaction has begun
            async with releasing.transaction():
                await release_claims(releasing, first)
            await placing.execute(
                "INSERT INTO allocation_resource_claims (allocation_id, node_id, slot_id, claim_kind, status, "
                "fencing_epoch) VALUES ($1, 'n1', 's1', 'slot', 'held', 2)",
                uuid.uuid4(),
            )
            await tx.commit()
        async with pool.acquire() as conn:
            assert await double_booking(conn) == []
