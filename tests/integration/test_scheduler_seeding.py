"""Seeding from the fleet file fabricates no evidence: nodes with parity unknown, slot bundles only as
unapproved candidates without disk evidence, nothing placeable; slots come only from the agent's
topology report, a passing parity run and an approval through the admin API, which records who approved."""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from gpuaas_common.contract import messages as m
from gpuaas_common.fleet import generate_fleet
from gpuaas_dev.sim.instant import InstantSliceHost
from gpuaas_scheduler.adapters import inventory as inv
from gpuaas_scheduler.adapters.repository import scheduler_repositories
from gpuaas_scheduler.service_layer import evidence
from gpuaas_scheduler.service_layer.placement import PlacementPolicy, place

from .scheduler_db import ADMIN_AUTH, admin_client, scheduler_pool

FLEET = generate_fleet(slice_hosts=1, slots_per_host=2, baremetal_hosts=1)
HOST = "slice-01"


@pytest.fixture
async def pool(fresh_db):
    async with scheduler_pool(fresh_db) as p:
        yield p


def slice_request() -> m.AllocationAccepted:
    return m.AllocationAccepted(
        allocation_id=uuid.uuid4(),
        tenant_id="t1",
        shape="gpu_slice",
        state="accepted",
        seq=2,
        sku="h200-sxm-slice",
        gpu_count=1,
        region="default",
        image=m.ImageRef(slug="img", digest_sha256="0" * 64, image_path="/img"),
    )


async def run_place(pool):
    async with pool.acquire() as conn, conn.transaction():
        return await place(conn, slice_request(), PlacementPolicy())


async def approve(api, actor: str, candidate_ids: list[str], status: int = 200) -> dict[str, Any]:
    resp = await api.post(
        f"/v1/nodes/{HOST}/candidates/approve",
        json={"actor": actor, "reason": "test", "candidate_ids": candidate_ids},
        headers={**ADMIN_AUTH, "Idempotency-Key": uuid.uuid4().hex},
    )
    assert resp.status == status, await resp.text()
    return await resp.json()


async def test_seeded_slots_are_candidates_until_discovery_parity_and_approval(pool):
    async with pool.acquire() as conn, conn.transaction():
        assert await inv.seed_from_fleet(conn, FLEET) == 2
    async with pool.acquire() as conn:
        assert await conn.fetchval("SELECT count(*) FROM node_resource_slots") == 0
        cands = await conn.fetch("SELECT * FROM candidate_slots ORDER BY candidate_id")
        node = await conn.fetchrow("SELECT * FROM nodes WHERE node_id = $1", HOST)
    assert [c["candidate_id"] for c in cands] == [s.slot_id for s in FLEET.node(HOST).slots]
    assert {(c["source"], c["nvme_evidence"], c["approved_slot_id"]) for c in cands} == {("fleet-seed", None, None)}
    assert (node["parity_failures"], node["parity_checked_at"], node["preflight_status"]) == (None, None, None)
    assert node["total_slots"] == 0 and node["mode"] == "slice"
    # Commissioning is tested on its own (test_scheduler_preflight); here only discovery, parity and approval.
    async with pool.acquire() as conn:
        await conn.execute("UPDATE nodes SET preflight_status = 'passed' WHERE node_id = $1", HOST)
    assert (await run_place(pool)).placed is None

    async with admin_client(pool) as api:
        # Before the host's agent ran parity, nothing is approved at all, not even a seeded bundle.
        refused = await approve(api, "ops", [cands[0]["candidate_id"]], status=409)
        assert refused["error"]["code"] == "readiness_gate" and set(refused["error"]["details"]["gates"]) == {"parity"}
        assert (await run_place(pool)).placed is None

        # The agent reports (an instant simulated host stands in for it), then ops approve.
        published: list[tuple[str, Any]] = []

        async def capture(type_: str, payload: Any, **_: Any) -> None:
            published.append((type_, payload))

        await InstantSliceHost(HOST, capture).report_host_state(FLEET.node(HOST))
        reports = dict(published)
        async with pool.acquire() as conn, conn.transaction():
            assert (
                await evidence.record_topology(scheduler_repositories(conn), reports["node.topology_reported"])
                == "applied"
            )
        # Discovery alone: the host's parity is still unknown.
        assert (await run_place(pool)).placed is None
        async with pool.acquire() as conn, conn.transaction():
            assert (
                await evidence.record_parity(scheduler_repositories(conn), reports["node.parity_reported"]) == "applied"
            )
        async with pool.acquire() as conn:
            found = await conn.fetch(
                "SELECT candidate_id FROM candidate_slots WHERE source = 'node-agent' ORDER BY candidate_id"
            )
        answer = await approve(api, "gpuaas-dev", [c["candidate_id"] for c in found])
    assert {r["status"] for r in answer["results"]} == {"available"}
    placed = (await run_place(pool)).placed
    assert placed is not None and placed.node_id == HOST
    async with pool.acquire() as conn:
        slots = await conn.fetch(
            "SELECT slot_id, status, approved_by, nvme_evidence IS NOT NULL AS evidence FROM node_resource_slots "
            "ORDER BY slot_id"
        )
        audit = await conn.fetchval(
            "SELECT count(*) FROM admin_audit WHERE actor = 'gpuaas-dev' AND action = 'candidates.approve'"
        )
    # Every slot is a discovered one (the seeded bundles were never approvable) and names its approver.
    assert [tuple(s) for s in slots] == [
        (f"{HOST}-0000:18:00.0", "reserved", "gpuaas-dev", True),  # the placement above took it
        (f"{HOST}-0000:2a:00.0", "available", "gpuaas-dev", True),
    ]
    assert audit == 1

    # A restart seeds again: nothing added, nothing undone.
    async with pool.acquire() as conn, conn.transaction():
        assert await inv.seed_from_fleet(conn, FLEET) == 0
    async with pool.acquire() as conn:
        # The seeded bundle discovery replaced does not come back.
        assert (
            await conn.fetchval(
                "SELECT count(*) FROM candidate_slots WHERE source = 'fleet-seed' AND approved_slot_id IS NULL"
            )
            == 0
        )
        assert await conn.fetchval("SELECT parity_failures FROM nodes WHERE node_id = $1", HOST) == 0
