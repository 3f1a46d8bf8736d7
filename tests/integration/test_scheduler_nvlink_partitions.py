"""NVLink partitions through the scheduler and a real Postgres (issue 29, points 1 and 2): slots approved from
candidates that carry module IDs are placed only on Fabric Manager partitions; an invalid pair ({1,2}) is never
placed; a degraded GPU removes its partitions; why-not speaks in partitions; concurrent placements in concurrent
transactions never get overlapping partitions; approval refuses an inconsistent module map."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime

import pytest

from gpuaas_common.contract import messages as m
from gpuaas_dev.testing.invariants import double_booking
from gpuaas_scheduler.adapters import inventory as inv
from gpuaas_scheduler.adapters.inventory.held import held_placement
from gpuaas_scheduler.adapters.repository import scheduler_repositories
from gpuaas_scheduler.domain import nvlink_partitions as nvl
from gpuaas_scheduler.service_layer.evidence import record_topology
from gpuaas_scheduler.service_layer.placement import PlacementPolicy, place, with_fleet_shape

from .scheduler_db import accepted, admin_client, candidate, post, report_ready, run_place, scheduler_pool

# The one real system of the partitions reference: bus -> module ID.
REAL_BOARD = {"0f": 5, "10": 7, "41": 6, "44": 8, "86": 1, "87": 3, "b8": 2, "bb": 4}


@pytest.fixture
async def pool(fresh_db):
    async with scheduler_pool(fresh_db, max_size=12) as p:
        yield p


@pytest.fixture
async def api(pool):
    async with admin_client(pool) as client:
        yield client


def board(node_id: str, modules: dict[str, int | None] | None = None) -> list[dict]:
    out = []
    for i, (bus, module) in enumerate((modules or REAL_BOARD).items()):
        out.append(
            candidate(
                i,
                candidate_id=f"{node_id}-c{i}",
                gpu_pci_address=f"0000:{bus}:00.0",
                numa_node=0 if (module or 0) <= 4 else 1,
                pcie_switch=f"sw{i // 2}",
                module_id=module,
            )
        )
    return out


async def host(api, pool, node_id: str = "h1", modules: dict[str, int | None] | None = None) -> dict:
    body = {
        "actor": "ops",
        "node_id": node_id,
        "kind": "slice_host",
        "hostname": node_id,
        "sku": "h200-sxm-slice",
        "maas_tags": [inv.TAG_SLICE],
    }
    assert (await post(api, "/v1/nodes", body))[0] == 200
    cands = {"actor": "ops", "candidates": board(node_id, modules)}
    assert (await post(api, f"/v1/nodes/{node_id}/candidates", cands, method="PUT"))[0] == 200
    await report_ready(pool, node_id)
    status, out = await post(api, f"/v1/nodes/{node_id}/candidates/approve", {"actor": "ops", "reason": "t"})
    assert status == 200, out
    return out


async def placed_modules(pool, placed: m.PlacementPlaced) -> frozenset[int]:
    async with pool.acquire() as conn:
        rows = await conn.fetch(
            "SELECT module_id FROM node_resource_slots WHERE slot_id = ANY($1::text[])",
            [s.slot_id for s in placed.slots],
        )
    return frozenset(r["module_id"] for r in rows)


async def degrade(pool, node_id: str, module: int) -> None:
    async with pool.acquire() as conn, conn.transaction():
        await conn.execute(
            "UPDATE node_resource_slots SET health_state = 'degraded' WHERE node_id = $1 AND module_id = $2",
            node_id,
            module,
        )
        await inv.refresh_nodes(conn, [node_id])


async def policy(pool) -> PlacementPolicy:
    async with pool.acquire() as conn:
        return await with_fleet_shape(conn, PlacementPolicy())


async def test_an_invalid_pair_is_never_placed_and_why_not_names_the_pair(api, pool) -> None:
    await host(api, pool)
    # Modules 3 and 4 degraded: 1 and 2 stay free on one socket, behind no common partition.
    await degrade(pool, "h1", 3)
    await degrade(pool, "h1", 4)
    pol = await policy(pool)
    got = []
    for _ in range(3):
        out = await run_place(pool, accepted(2), pol)
        if out.placed is None:
            break
        modules = await placed_modules(pool, out.placed)
        assert frozenset(s.module_id for s in out.placed.slots) == modules
        assert nvl.BY_ID[out.placed.nvlink_partition].modules == modules
        got.append(modules)
    assert sorted(map(sorted, got)) == [[5, 7], [6, 8]]
    assert out.placed is None and out.unschedulable.reason_code == "no_partition"
    assert out.unschedulable.reason.startswith(
        "2 GPUs free, no free 2-GPU partition: 2 pairs have a tenant, 2 a degraded or excluded GPU"
    ), out.unschedulable.reason
    # The two free GPUs still serve 1-GPU slices, each on its single-GPU partition.
    singles = [(await run_place(pool, accepted(1), pol)).placed for _ in range(2)]
    assert sorted(s.nvlink_partition for s in singles) == [7, 8]


async def test_a_degraded_gpu_removes_every_partition_holding_it(api, pool) -> None:
    await host(api, pool)
    await degrade(pool, "h1", 2)
    await degrade(pool, "h1", 6)
    pol = await policy(pool)
    out = await run_place(pool, accepted(4), pol)
    assert out.unschedulable.reason_code == "no_partition"
    assert out.unschedulable.reason.startswith(
        "6 GPUs free, no free 4-GPU partition: every half has a degraded or excluded GPU"
    ), out.unschedulable.reason
    pairs = [(await run_place(pool, accepted(2), pol)).placed for _ in range(2)]
    assert sorted([sorted(await placed_modules(pool, p)) for p in pairs]) == [[1, 3], [5, 7]]
    pair = pairs[1]
    # The placement a re-ask gets back names the same partition, from the claimed slots' module IDs.
    async with pool.acquire() as conn:
        again = await held_placement(conn, pair.allocation_id)
    assert again.nvlink_partition == pair.nvlink_partition and [s.module_id for s in again.slots] == [
        s.module_id for s in pair.slots
    ]


async def test_concurrent_placements_never_get_overlapping_partitions(api, pool) -> None:
    await host(api, pool, "h1")
    await host(api, pool, "h2")
    pol = await policy(pool)
    sizes = [1, 2, 4, 2, 1, 1, 2, 4, 8, 2, 1]
    gate, all_open = asyncio.Event(), asyncio.Event()
    opened = 0

    async def one(gpus: int):
        nonlocal opened
        async with pool.acquire() as conn, conn.transaction():
            opened += 1
            if opened == len(sizes):
                all_open.set()
            await gate.wait()  # every transaction open before any places
            return await place(conn, accepted(gpus), pol)

    tasks = [asyncio.create_task(one(g)) for g in sizes]
    await all_open.wait()
    gate.set()
    outcomes = await asyncio.gather(*tasks)
    taken: dict[str, list[frozenset[int]]] = {"h1": [], "h2": []}
    for out in outcomes:
        if out.placed is None:
            continue
        modules = await placed_modules(pool, out.placed)
        assert nvl.partition_for(modules) is nvl.BY_ID[out.placed.nvlink_partition]
        taken[out.placed.node_id].append(modules)
    for node, parts in taken.items():
        flat = [mid for p in parts for mid in p]
        assert len(flat) == len(set(flat)), f"{node}: overlapping partitions {parts}"
    # Nothing is released, so free partitions only shrink: every refusal must still hold at the end.
    free = {
        node: {mid: nvl.GpuState() for mid in range(1, 9) if all(mid not in p for p in parts)}
        for node, parts in taken.items()
    }
    refused = [g for g, out in zip(sizes, outcomes, strict=True) if out.placed is None]
    for gpus in refused:
        assert not any(nvl.feasible_partitions(f, gpus) for f in free.values()), f"{gpus}-GPU refused yet fits"
    assert len(refused) < len(sizes)
    async with pool.acquire() as conn:
        assert await double_booking(conn) == []


async def test_approval_refuses_an_inconsistent_module_map(api, pool) -> None:
    mixed = dict(REAL_BOARD, **{"bb": None})
    out = await host(api, pool, "h1", mixed)
    problems = {r["candidate_id"]: r["problems"] for r in out["results"]}
    assert any("without a module ID" in p for p in problems["h1-c0"])
    assert any("has no module ID" in p for p in problems["h1-c7"])
    doubled = dict(REAL_BOARD, **{"bb": 1})
    out = await host(api, pool, "h2", doubled)
    bad = sorted(r["candidate_id"] for r in out["results"] if r["status"] == "disabled")
    assert bad == ["h2-c4", "h2-c7"]  # bus 86 and bb both claim module 1


async def test_discovered_module_ids_and_fabric_manager_reach_the_candidates_and_the_node(api, pool) -> None:
    assert (
        await post(
            api,
            "/v1/nodes",
            {"actor": "ops", "node_id": "h1", "kind": "slice_host", "hostname": "h1", "sku": "h200-sxm-slice"},
        )
    )[0] == 200
    report = m.NodeTopologyReported(
        node_id="h1",
        discovered_at=datetime.now(UTC),
        candidate_slots=[
            m.CandidateSlot(
                **{k: v for k, v in c.items() if k not in ("candidate_id", "nvme_evidence")},
                index=i,
                ovs_port=f"p{i}",
                complete=True,
            )
            for i, c in enumerate(board("h1"))
        ],  # fmt: skip
        fabric_manager=m.FabricManagerInfo(mode="shared_nvswitch", version="550.127.05", active=True),
    )
    async with pool.acquire() as conn, conn.transaction():
        assert await record_topology(scheduler_repositories(conn), report) == "applied"
    async with pool.acquire() as conn:
        cands = await conn.fetch("SELECT gpu_pci_address, module_id FROM candidate_slots WHERE node_id = 'h1'")
        node = await conn.fetchrow("SELECT fabric_manager_mode, fabric_manager_version FROM nodes WHERE node_id='h1'")
    assert {r["gpu_pci_address"][5:7]: r["module_id"] for r in cands} == REAL_BOARD
    assert tuple(node) == ("shared_nvswitch", "550.127.05")


def with_driver(ev: m.AllocationAccepted, version: str) -> m.AllocationAccepted:
    return ev.model_copy(update={"image": ev.image.model_copy(update={"driver_version": version})})


async def set_fabric_manager(pool, node_id: str, version: str | None) -> None:
    async with pool.acquire() as conn:
        await conn.execute("UPDATE nodes SET fabric_manager_version = $2 WHERE node_id = $1", node_id, version)


async def test_a_slice_goes_only_where_fabric_manager_matches_the_guest_driver(api, pool) -> None:
    """Issue 29, point 4: the catalog's guest driver version against each partitioned host's Fabric Manager."""
    await host(api, pool, "h1")
    await host(api, pool, "h2")
    await set_fabric_manager(pool, "h1", "550.127.05")
    await set_fabric_manager(pool, "h2", None)  # never reported
    pol = await policy(pool)
    out = await run_place(pool, with_driver(accepted(2), "580.159.04"), pol)
    assert out.placed is None and out.unschedulable.reason_code == "no_eligible_node"
    assert out.unschedulable.filtered == {"fabric_manager_version": 2}
    assert out.unschedulable.reason.endswith(
        "the image's driver is 580.159.04, their Fabric Manager: 550.127.05 (1), not reported (1)"
    ), out.unschedulable.reason
    # An image that names no driver version is not gated.
    assert (await run_place(pool, accepted(1), pol)).placed is not None
    await set_fabric_manager(pool, "h2", "580.159.04")
    placed = (await run_place(pool, with_driver(accepted(2), "580.159.04"), pol)).placed
    assert placed is not None and placed.node_id == "h2"
