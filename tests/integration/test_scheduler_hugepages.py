"""1 GiB hugepages as host capability evidence, over real Postgres: the agent's topology report carries them
into the scheduler (through its bus handler), and slices of a profile that opts into hugepages (the tuned
h200_1g_24c_64g of every synthetic slot) are placed only on hosts whose configured pages, less those their
live claims hold, cover the request; otherwise the why-not answer names the hugepages."""

from __future__ import annotations

import uuid
from datetime import datetime, timedelta, timezone

import pytest

from gpuaas_common.contract import messages as m
from gpuaas_scheduler.adapters import synthetic
from gpuaas_scheduler.adapters.inventory import node_facts
from gpuaas_scheduler.adapters.inventory.predicates import hugepage_table, hugepages_ok_sql
from gpuaas_scheduler.domain.placement import Request, hugepages_insufficient, hugepages_missing
from gpuaas_scheduler.service_layer.handlers import Scheduler, fail_allocation
from gpuaas_scheduler.service_layer.placement import PlacementPolicy
from gpuaas_scheduler.service_layer.placement import place as place_in_tx

from .scheduler_db import scheduler_pool
from .test_scheduler_evidence import deliver, place

T0 = datetime(2025, 1, 1, tzinfo=timezone.utc)


@pytest.fixture
async def pool(fresh_db):
    async with scheduler_pool(fresh_db, max_size=2) as p:
        yield p


@pytest.fixture
def scheduler():
    return Scheduler(PlacementPolicy())


def topology(node_id: str, at: datetime, total: int | None = None, free: int | None = None) -> m.NodeTopologyReported:
    return m.NodeTopologyReported(node_id=node_id, discovered_at=at, hugepages_1g_total=total, hugepages_1g_free=free)


def accepted(gpus: int = 1) -> m.AllocationAccepted:
    return m.AllocationAccepted(
        allocation_id=uuid.uuid4(),
        tenant_id="t1",
        shape="gpu_slice",
        state="accepted",
        seq=2,
        sku="h200-sxm-slice",
        gpu_count=gpus,
        region="default",
        image=m.ImageRef(slug="img", digest_sha256="a" * 64, image_path="/img"),
    )


async def run_place(pool, gpus: int = 1):
    async with pool.acquire() as conn, conn.transaction():
        return await place_in_tx(conn, accepted(gpus), PlacementPolicy())


async def set_hugepages(pool, node_id: str, total: int | None) -> None:
    async with pool.acquire() as conn:
        await conn.execute("UPDATE nodes SET hugepages_1g_total = $2 WHERE node_id = $1", node_id, total)


async def test_a_host_reporting_no_hugepages_is_refused_with_the_reason_and_placed_once_it_reports_them(
    pool, scheduler
):
    async with pool.acquire() as conn:
        await synthetic.build(conn, slice_hosts=1)
    # An agent that reports no hugepage counts (an older one) leaves the capacity unknown: no pages.
    await deliver(pool, scheduler, "node.topology_reported", topology("n00001", T0))
    kind, answer = await place(pool, scheduler)
    assert kind == "placement.unschedulable"
    assert answer["reason_code"] == "no_eligible_node" and answer["filtered"] == {"hugepages_missing": 1}
    assert "1 without the 1 GiB hugepages their slot profile needs" in answer["reason"]
    # A host that staged none is refused alike.
    await deliver(pool, scheduler, "node.topology_reported", topology("n00001", T0 + timedelta(minutes=1), 0, 0))
    kind, answer = await place(pool, scheduler)
    assert kind == "placement.unschedulable" and answer["filtered"] == {"hugepages_missing": 1}
    # The runbook's 512 staged pages: placed, and the evidence is on the node.
    await deliver(pool, scheduler, "node.topology_reported", topology("n00001", T0 + timedelta(minutes=2), 512, 500))
    kind, answer = await place(pool, scheduler, gpus=4)
    assert kind == "placement.placed" and answer["node_id"] == "n00001" and len(answer["slots"]) == 4
    row = await pool.fetchrow("SELECT hugepages_1g_total, hugepages_1g_free FROM nodes WHERE node_id = 'n00001'")
    assert (row["hugepages_1g_total"], row["hugepages_1g_free"]) == (512, 500)
    # A late redelivery of an old report does not roll the capacity back.
    await deliver(pool, scheduler, "node.topology_reported", topology("n00001", T0, 0, 0))
    assert await pool.fetchval("SELECT hugepages_1g_total FROM nodes WHERE node_id = 'n00001'") == 512


async def test_placement_passes_over_a_better_ranked_host_without_hugepages(pool):
    async with pool.acquire() as conn:
        await synthetic.build(conn, slice_hosts=2)
    # n00001 is sliced, so the ranking prefers it for every slice ...
    first = (await run_place(pool)).placed
    assert first.node_id == "n00001"
    # ... until it has no hugepages: then the slice goes to the host that has them, not nowhere.
    await set_hugepages(pool, "n00001", 0)
    for _ in range(3):
        assert (await run_place(pool)).placed.node_id == "n00002"
    await set_hugepages(pool, "n00002", None)
    out = await run_place(pool)
    assert out.placed is None and out.unschedulable.filtered == {"hugepages_missing": 2}


async def test_pages_held_by_live_claims_are_not_offered_twice(pool):
    async with pool.acquire() as conn:
        await synthetic.build(conn, slice_hosts=1)
    # 128 pages back two GPUs of the tuned profile (64 each), though the host has eight slots.
    await set_hugepages(pool, "n00001", 128)
    out = await run_place(pool, gpus=4)
    assert out.unschedulable.reason_code == "no_eligible_node"
    assert out.unschedulable.filtered == {"hugepages_missing": 1}
    a = (await run_place(pool)).placed
    b = (await run_place(pool)).placed
    assert a and b
    out = await run_place(pool)
    assert out.placed is None
    assert out.unschedulable.reason_code == "hugepages_insufficient"
    assert out.unschedulable.filtered == {"hugepages_insufficient": 1} and out.unschedulable.free_gpus == 6
    # A claim released (before the disk was touched) gives its pages back.
    async with pool.acquire() as conn, conn.transaction():
        await fail_allocation(conn, a.allocation_id, False, "agent refused before the disk")
    assert (await run_place(pool)).placed.node_id == "n00001"


async def test_the_sql_predicate_and_the_domain_filters_agree(pool):
    async with pool.acquire() as conn:
        await synthetic.build(conn, slice_hosts=6)
        for node_id, total in zip(
            ["n00001", "n00002", "n00003", "n00004", "n00005", "n00006"], [None, 0, 64, 192, 256, 512], strict=True
        ):
            await conn.execute("UPDATE nodes SET hugepages_1g_total = $2 WHERE node_id = $1", node_id, total)
        # A profile without hugepages on one host: its slots need none.
        await conn.execute("UPDATE node_resource_slots SET profile = 'h200_1g_16c_32g' WHERE node_id = 'n00006'")
    # Live claims hold pages on some hosts.
    for _ in range(3):
        await run_place(pool)
    async with pool.acquire() as conn:
        facts = {f.node_id: f for f in await node_facts(conn)}
        assert sum(f.hugepages_1g_held for f in facts.values()) > 0
        assert facts["n00006"].hugepages_1g_per_gpu == 0 and facts["n00005"].hugepages_1g_per_gpu == 64
        for gpus in range(1, 9):
            rows = await conn.fetch(
                f"SELECT n.node_id, {hugepages_ok_sql(1, 2)} AS ok FROM nodes n", gpus, hugepage_table()
            )
            req = Request("gpu_slice", gpus, "default", "h200-sxm-slice")
            for r in rows:
                f = facts[r["node_id"]]
                assert r["ok"] == (not hugepages_missing(f, req) and not hugepages_insufficient(f, req)), (f, gpus)
