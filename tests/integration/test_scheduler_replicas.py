"""Two scheduler replicas on one allocation, over real Postgres, through the scheduler's own handlers.

In one process the bus keeps one allocation's messages in order (keyed lanes); across replicas two of
them can be handled at the same time, in either order. The handlers serialise on the allocation and
make a message that overtook its predecessor wait (retry) instead of applying it out of order.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import pytest
import pytest_asyncio

from gpuaas_common.bus import HandlerContext
from gpuaas_common.bus import deliver as bus_deliver
from gpuaas_common.contract import messages as m
from gpuaas_common.contract.catalog import spec_for
from gpuaas_common.contract.envelope import Envelope
from gpuaas_common.unit_of_work import UnitOfWork
from gpuaas_dev.testing.waiting import eventually
from gpuaas_scheduler.adapters import synthetic
from gpuaas_scheduler.adapters.inventory import refresh_nodes
from gpuaas_scheduler.adapters.repository import scheduler_repositories
from gpuaas_scheduler.service_layer.handlers import ArrivedEarly, Scheduler
from gpuaas_scheduler.service_layer.placement import PlacementPolicy

from .scheduler_db import scheduler_pool

DURABLE = "scheduler-allocation-events"


@pytest_asyncio.fixture
async def pool(fresh_db: str) -> AsyncIterator[asyncpg.Pool]:
    async with scheduler_pool(fresh_db, max_size=6) as p:
        async with p.acquire() as conn:
            await synthetic.build(conn, slice_hosts=2)
        yield p


def accepted(alloc: uuid.UUID) -> m.AllocationAccepted:
    return m.AllocationAccepted(
        allocation_id=alloc,
        tenant_id="t1",
        shape="gpu_slice",
        state="accepted",
        seq=2,
        sku="h200-sxm-slice",
        gpu_count=1,
        region="default",
        image=m.ImageRef(slug="img", digest_sha256="0" * 64, image_path="/img"),
    )


def context(type_: str, payload: Any) -> HandlerContext:
    env = Envelope.wrap(type_, payload.model_dump(mode="json"), producer="test", correlation_id="test")
    return HandlerContext(env, payload, spec_for(type_).address, DURABLE, 1)


def uow(pool: asyncpg.Pool) -> UnitOfWork[Any]:
    return UnitOfWork(pool, "scheduler", "scheduler", scheduler_repositories)


async def deliver(pool: asyncpg.Pool, handler: Any, type_: str, payload: Any) -> None:
    assert await bus_deliver(handler, context(type_, payload), uow(pool))


async def slot_statuses(pool: asyncpg.Pool, alloc: uuid.UUID) -> list[str]:
    rows = await pool.fetch(
        "SELECT s.status FROM allocation_resource_claims c JOIN node_resource_slots s ON s.slot_id = c.slot_id "
        "WHERE c.allocation_id = $1 AND c.status <> 'released'",
        alloc,
    )
    return [r["status"] for r in rows]


async def test_active_that_overtook_provisioning_waits_for_it(pool: asyncpg.Pool) -> None:
    scheduler = Scheduler(PlacementPolicy())
    alloc = uuid.uuid4()
    await deliver(pool, scheduler.on_accepted, "allocation.accepted", accepted(alloc))
    assert await slot_statuses(pool, alloc) == ["reserved"]
    node = await pool.fetchval("SELECT node_id FROM allocation_resource_claims WHERE allocation_id = $1", alloc)
    common = {"allocation_id": alloc, "tenant_id": "t1", "shape": "gpu_slice", "node_id": node}
    active = m.AllocationActive(**common, state="active", seq=5, access=m.AccessInfo(ip="10.0.0.5"))
    provisioning = m.AllocationProvisioning(**common, state="provisioning", seq=4, task_id="task-1")

    # Another replica has not applied `provisioning` yet: `active` changes nothing and is retried.
    with pytest.raises(ArrivedEarly):
        await deliver(pool, scheduler.on_active, "allocation.active", active)
    assert await slot_statuses(pool, alloc) == ["reserved"]
    assert await pool.fetchval("SELECT count(*) FROM inbox") == 1  # only `accepted`: the retry is not deduplicated

    await deliver(pool, scheduler.on_provisioning, "allocation.provisioning", provisioning)
    await deliver(pool, scheduler.on_active, "allocation.active", active)
    assert await slot_statuses(pool, alloc) == ["active"]


async def test_a_repeated_placement_on_another_replica_waits_and_answers_with_the_same_claim(
    pool: asyncpg.Pool,
) -> None:
    """The allocator re-asks a placement (new event id) while the first request is still being placed by
    another replica: the second waits for the first and repeats its answer instead of placing again."""
    one, two = Scheduler(PlacementPolicy()), Scheduler(PlacementPolicy())
    alloc = uuid.uuid4()
    first = uow(pool)
    async with first:
        ctx = context("allocation.accepted", accepted(alloc))
        ctx.uow = first
        await one.on_accepted(ctx)
        # The first replica holds its transaction open; the second takes the re-asked placement.
        second = asyncio.ensure_future(
            bus_deliver(two.on_accepted, context("allocation.accepted", accepted(alloc)), uow(pool))
        )

        async def second_waits() -> bool:
            return bool(
                await pool.fetchval("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted")
            )

        try:
            await eventually(second_waits, timeout=10, interval=0.01, what="the second replica waiting")
        except BaseException:
            second.cancel()
            await asyncio.gather(second, return_exceptions=True)
            raise
        await first.commit()
    assert await second

    claims = await pool.fetch("SELECT node_id, slot_id FROM allocation_resource_claims WHERE allocation_id = $1", alloc)
    assert len(claims) == 1
    answers = [
        json.loads(bytes(r["body"]))
        for r in await pool.fetch("SELECT body FROM outbox WHERE aggregate_id = $1 ORDER BY id", str(alloc))
    ]
    assert [a["type"] for a in answers] == ["placement.placed", "placement.placed"]
    assert {a["payload"]["node_id"] for a in answers} == {claims[0]["node_id"]}
    assert [[s["slot_id"] for s in a["payload"]["slots"]] for a in answers] == [[claims[0]["slot_id"]]] * 2


async def node_summary(pool: asyncpg.Pool | asyncpg.Connection, node: str) -> tuple[Any, ...]:
    row = await pool.fetchrow(
        "SELECT free_slots, total_slots, sliced, max_switch_free, max_numa_free, numa_free, numa_capacity "
        "FROM nodes WHERE node_id = $1",
        node,
    )
    return tuple(row)


async def test_a_releases_capacity_summary_is_written_in_its_unit_of_work_and_not_without_its_commit(
    pool: asyncpg.Pool,
) -> None:
    """`released` writes the node's capacity summary in its unit of work: it equals the summary computed from
    scratch, and a unit of work that never commits leaves the summary (and everything else) as it was."""
    scheduler = Scheduler(PlacementPolicy())
    alloc = uuid.uuid4()
    await deliver(pool, scheduler.on_accepted, "allocation.accepted", accepted(alloc))
    node = await pool.fetchval("SELECT node_id FROM allocation_resource_claims WHERE allocation_id = $1", alloc)
    held = await node_summary(pool, node)
    ids = {"allocation_id": alloc, "tenant_id": "t1", "shape": "gpu_slice"}
    # Released before provisioning: the slot is free again.
    unwritten = m.CleanupReport(required=False, verified=False, reason="released before provisioning")
    released = m.AllocationReleased(**ids, node_id=node, state="released", seq=4, cleanup=unwritten)

    abandoned = uow(pool)
    async with abandoned:
        ctx = context("allocation.released", released)
        ctx.uow = abandoned
        await scheduler.on_released(ctx)
        assert (await node_summary(abandoned.conn, node))[0] == held[0] + 1  # written, seen in its transaction
    assert await node_summary(pool, node) == held
    assert await slot_statuses(pool, alloc) == ["reserved"]

    await deliver(pool, scheduler.on_released, "allocation.released", released)
    assert await slot_statuses(pool, alloc) == []  # no live claim left
    after = await node_summary(pool, node)
    assert after[0] == held[0] + 1
    async with pool.acquire() as conn:
        await refresh_nodes(conn, [node])  # from scratch, written at once
    assert after == await node_summary(pool, node)
