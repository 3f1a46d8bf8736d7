"""Eight scheduler worker processes place 2,000 mixed requests on 200 hosts at once: zero double
booking (unique indexes and an audit query) and every unschedulable answer provably true.

No request releases anything, so free capacity only shrinks: a request answered "unschedulable" at
time t must still be unplaceable in the final inventory. That turns "correct reason" into a check.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import random
import uuid

import asyncpg

from gpuaas_common.contract import messages as m
from gpuaas_common.migrations import apply_migrations
from gpuaas_common.outbox import OutboxWriter
from gpuaas_scheduler.adapters import synthetic
from gpuaas_scheduler.domain.placement import SlotView, choose
from gpuaas_scheduler.service_layer.placement import PlacementPolicy, place

WORKERS, NODES, REQUESTS, BAREMETAL = 8, 200, 2000, 10
QUOTA_TENANT, QUOTA = "capped", 40


def make_requests(seed: int = 11) -> list[tuple[str, str, int, str]]:
    rng = random.Random(seed)
    out = []
    for i in range(REQUESTS):
        roll = rng.random()
        shape, gpus = ("baremetal", 8) if roll < 0.01 else ("gpu_slice", rng.choice([1, 1, 1, 2, 2, 4, 8]))
        tenant = QUOTA_TENANT if i % 10 == 0 else f"t{i % 37}"
        out.append((str(uuid.UUID(int=rng.getrandbits(128))), shape, gpus, tenant))
    return out


async def _work(dsn: str, jobs: list[tuple[str, str, int, str]]) -> list[tuple[str, str, str]]:
    conn = await asyncpg.connect(dsn, server_settings={"search_path": "scheduler"})
    results = []
    try:
        for alloc, shape, gpus, tenant in jobs:
            ev = m.AllocationAccepted(
                allocation_id=uuid.UUID(alloc),
                tenant_id=tenant,
                shape=shape,
                state="accepted",
                seq=2,
                sku="h200-sxm" if shape == "baremetal" else "h200-sxm-slice",
                gpu_count=gpus,
                region="default",
                image=m.ImageRef(slug="img", digest_sha256="0" * 64, image_path="/img"),
            )
            async with conn.transaction():
                outcome = await place(conn, ev, PlacementPolicy())
                outbox = OutboxWriter(conn, "scheduler", "scheduler")
                kind = "placement.placed" if outcome.placed else "placement.unschedulable"
                await outbox.add(kind, outcome.placed or outcome.unschedulable, aggregate_id=alloc)
            code = "placed" if outcome.placed else outcome.unschedulable.reason_code
            results.append((alloc, code, outcome.placed.node_id if outcome.placed else ""))
    finally:
        await conn.close()
    return results


def worker(dsn: str, jobs: list[tuple[str, str, int, str]]) -> list[tuple[str, str, str]]:
    return asyncio.run(_work(dsn, jobs))


async def test_eight_processes_never_double_book_and_every_refusal_is_true(fresh_db):
    conn = await asyncpg.connect(fresh_db, server_settings={"search_path": "scheduler"})
    await apply_migrations(conn, "scheduler", "gpuaas_scheduler.migrations")
    await synthetic.build(conn, slice_hosts=NODES, baremetal_hosts=BAREMETAL)
    await conn.execute(
        "INSERT INTO tenant_quotas (tenant_id, max_gpus, updated_by) VALUES ($1, $2, 'test')", QUOTA_TENANT, QUOTA
    )
    requests = make_requests()
    chunks = [requests[i::WORKERS] for i in range(WORKERS)]
    ctx = mp.get_context("spawn")
    loop = asyncio.get_running_loop()
    with ctx.Pool(WORKERS) as pool:
        parts = await loop.run_in_executor(None, lambda: pool.starmap(worker, [(fresh_db, c) for c in chunks]))
    results = {alloc: (code, node) for part in parts for alloc, code, node in part}
    assert len(results) == REQUESTS
    by_id = {r[0]: r for r in requests}

    # 1. The audit: no slot or node under two live claims, claims match slot states and requests.
    assert (
        await conn.fetchval(
            "SELECT count(*) FROM (SELECT slot_id FROM allocation_resource_claims WHERE status <> 'released' "
            "AND slot_id IS NOT NULL GROUP BY slot_id HAVING count(*) > 1) d"
        )
        == 0
    )
    assert (
        await conn.fetchval(
            "SELECT count(*) FROM allocation_resource_claims a JOIN allocation_resource_claims b "
            "ON a.node_id = b.node_id AND a.claim_id <> b.claim_id "
            "AND a.status <> 'released' AND b.status <> 'released' "
            "WHERE a.claim_kind = 'node_exclusive'"
        )
        == 0
    )
    assert (
        await conn.fetchval(
            "SELECT count(*) FROM node_resource_slots s WHERE (s.status = 'reserved') <> EXISTS (SELECT 1 FROM "
            "allocation_resource_claims c WHERE c.slot_id = s.slot_id AND c.status <> 'released')"
        )
        == 0
    )
    claims = await conn.fetch(
        "SELECT allocation_id::text AS a, count(*) AS n, count(DISTINCT node_id) AS nodes, min(claim_kind) AS kind, "
        "sum(gpus) AS gpus FROM allocation_resource_claims GROUP BY allocation_id"
    )
    placed = {alloc for alloc, (code, _) in results.items() if code == "placed"}
    assert {r["a"] for r in claims} == placed
    for r in claims:
        _, shape, gpus, _ = by_id[r["a"]]
        assert r["nodes"] == 1 and r["gpus"] == gpus
        assert r["kind"] == ("node_exclusive" if shape == "baremetal" else "slot")
    # Every multi-GPU group is topology-safe (one NUMA node for 2 and 4 GPUs).
    spans = await conn.fetch(
        "SELECT c.allocation_id::text AS a, count(DISTINCT s.numa_node) AS numa FROM allocation_resource_claims c "
        "JOIN node_resource_slots s USING (slot_id) GROUP BY c.allocation_id"
    )
    for r in spans:
        assert r["numa"] == (2 if by_id[r["a"]][2] == 8 else 1)
    assert await conn.fetchval("SELECT count(*) FROM outbox") == REQUESTS

    # 2. Every refusal still holds on the final (smaller) inventory.
    free = await conn.fetch(
        "SELECT node_id, slot_id, numa_node, pcie_switch, fabric_vf_pci_address FROM "
        "node_resource_slots WHERE status = 'available'"
    )
    per_node: dict[str, list[SlotView]] = {}
    for r in free:
        per_node.setdefault(r["node_id"], []).append(
            SlotView(r["slot_id"], r["numa_node"], r["pcie_switch"], r["fabric_vf_pci_address"])
        )
    clean_bm = await conn.fetchval(
        "SELECT count(*) FROM nodes n WHERE accepts_baremetal AND NOT EXISTS (SELECT 1 FROM allocation_resource_claims "
        "c WHERE c.node_id = n.node_id AND c.status <> 'released')"
    )
    capped_used = await conn.fetchval(
        "SELECT COALESCE(sum(gpus), 0) FROM allocation_resource_claims WHERE tenant_id = $1", QUOTA_TENANT
    )
    assert capped_used <= QUOTA
    codes = set()
    for alloc, (code, _) in results.items():
        _, shape, gpus, tenant = by_id[alloc]
        codes.add(code)
        if code == "placed":
            continue
        if code == "quota_exceeded":
            assert tenant == QUOTA_TENANT and capped_used + gpus > QUOTA
        elif shape == "baremetal":
            assert code == "no_capacity" and clean_bm == 0
        else:
            assert code in ("no_capacity", "insufficient_capacity", "fragmented", "topology"), code
            fits = [n for n, slots in per_node.items() if choose(slots, gpus, 4)]
            assert not fits, f"{alloc} ({gpus} GPUs) refused with {code}, but {fits[:3]} fit"
    assert "placed" in codes and "quota_exceeded" in codes and len(codes) >= 3
    await conn.close()
