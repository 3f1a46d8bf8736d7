"""The scheduler's inventory over real Postgres: approval through the admin HTTP API, the placement-time
re-checks of hand-edited rows, why-not answers, quota, and the release/cleanup/repair paths."""

from __future__ import annotations

import uuid

import pytest

from gpuaas_common.contract import messages as m
from gpuaas_common.outbox import OutboxWriter
from gpuaas_common.profiles import DEFAULT_PROFILE
from gpuaas_scheduler.adapters import admin_slots, synthetic
from gpuaas_scheduler.adapters import inventory as inv
from gpuaas_scheduler.adapters.repository import scheduler_repositories
from gpuaas_scheduler.domain.placement import rank_classes, rank_nodes
from gpuaas_scheduler.domain.slots import InvalidSlotTransition
from gpuaas_scheduler.service_layer import slot_wipe
from gpuaas_scheduler.service_layer.evidence import record_slice_preflight, record_topology
from gpuaas_scheduler.service_layer.handlers import EndedOutOfOrder, fail_allocation, release_allocation
from gpuaas_scheduler.service_layer.placement import PlacementPolicy

from .scheduler_db import (
    ADMIN_AUTH,
    CLEAN,
    accepted,
    admin_client,
    candidate,
    place_and_activate,
    post,
    report_ready,
    run_place,
    scheduler_pool,
)


@pytest.fixture
async def pool(fresh_db):
    async with scheduler_pool(fresh_db) as p:
        yield p


@pytest.fixture
async def api(pool):
    async with admin_client(pool) as client:
        yield client


def preflight_report(node_id, status, *, system_id="sys-h1", op="pf-1", reasons=()):
    from datetime import UTC, datetime

    return m.NodeSlicePreflightReported(
        operation_id=op,
        site="default",
        system_id=system_id,
        node_id=node_id,
        script_name="50-gpuaas-slice-firmware-preflight",
        status=status,
        reasons=list(reasons),
        reported_at=datetime.now(UTC),
    )


def topology_report(node_id, *, hugepages, free=None):
    from datetime import UTC, datetime

    return m.NodeTopologyReported(
        node_id=node_id,
        discovered_at=datetime.now(UTC),
        hugepages_1g_total=hugepages,
        hugepages_1g_free=hugepages if free is None else free,
    )


VIOLATIONS = [
    ({"gpu_pci_address": None}, "GPU PCI"),
    ({"nvme_by_id": "/dev/nvme3n1"}, "by-id"),
    ({"mac": None}, "MAC"),
    ({"private_ip": None}, "private IP"),
    ({"fabric_claim_mode": "shared"}, "per_slot_vf"),
    ({"fabric_vf_pci_address": None}, "fabric VF"),
    ({"nvme_evidence": {**CLEAN, "mounted_children": ["nvme3n1p1"]}}, "mounted children"),
    ({"nvme_evidence": {**CLEAN, "signatures": ["xfs"]}}, "unexpected filesystems"),
    ({"nvme_evidence": {**CLEAN, "mounted": True}}, "is mounted"),
    ({"nvme_evidence": None}, "no NVMe evidence"),
]


async def test_approval_enforces_every_rule_through_the_api(api, pool):
    status, _ = await post(
        api,
        "/v1/nodes",
        {
            "actor": "ops",
            "node_id": "h1",
            "kind": "slice_host",
            "hostname": "h1",
            "sku": "h200-sxm-slice",
            "maas_tags": [inv.TAG_SLICE],
        },
    )
    assert status == 200
    cands = [candidate(0)] + [candidate(i + 1, **change) for i, (change, _) in enumerate(VIOLATIONS)]
    status, body = await post(api, "/v1/nodes/h1/candidates", {"actor": "ops", "candidates": cands}, method="PUT")
    assert status == 200 and len(body["candidates"]) == len(cands)
    # No parity run and no commissioning preflight yet: the approval gate refuses, naming both, and writes nothing.
    status, body = await post(api, "/v1/nodes/h1/candidates/approve", {"actor": "ops", "reason": "first light"})
    assert status == 409 and body["error"]["code"] == "readiness_gate"
    assert set(body["error"]["details"]["gates"]) == {"parity", "preflight"}
    async with pool.acquire() as conn:
        assert await conn.fetchval("SELECT count(*) FROM node_resource_slots WHERE node_id = 'h1'") == 0
    await report_ready(pool, "h1")
    status, body = await post(api, "/v1/nodes/h1/candidates/approve", {"actor": "ops", "reason": "first light"})
    assert status == 200
    results = {r["candidate_id"]: r for r in body["results"]}
    assert results["h1-c0"]["status"] == "available" and results["h1-c0"]["problems"] == []
    for i, (_, needle) in enumerate(VIOLATIONS):
        r = results[f"h1-c{i + 1}"]
        assert r["status"] == "disabled" and any(needle in p for p in r["problems"]), (needle, r)
    resp = await api.get("/v1/nodes/h1/slots", headers=ADMIN_AUTH)
    slots = {s["slot_id"]: s for s in (await resp.json())["slots"]}
    assert slots["h1-c0"]["status"] == "available" and slots["h1-c0"]["approved_by"] == "ops"
    assert "mounted children" in slots["h1-c7"]["status_reason"]
    # Candidates stay apart from slots.
    resp = await api.get("/v1/nodes/h1/candidates", headers=ADMIN_AUTH)
    assert len((await resp.json())["candidates"]) == len(cands)
    # The default profile is plain: a host that never reported 1 GiB hugepages serves it.
    assert slots["h1-c0"]["profile"] == DEFAULT_PROFILE
    placed = (await run_place(pool, accepted())).placed
    assert placed and [s.slot_id for s in placed.slots] == ["h1-c0"] and placed.slots[0].profile == DEFAULT_PROFILE


async def test_the_tuned_profile_is_opt_in_per_host_pool_and_why_not_names_it(api, pool):
    for node_id in ("plain", "tuned"):
        body = {"actor": "ops", "node_id": node_id, "kind": "slice_host", "hostname": node_id}
        body |= {"sku": "h200-sxm-slice", "maas_tags": [inv.TAG_SLICE]}
        assert (await post(api, "/v1/nodes", body))[0] == 200
        async with pool.acquire() as conn:
            # Neither host staged 1 GiB pages.
            await record_topology(scheduler_repositories(conn), topology_report(node_id, hugepages=0))
        cand = candidate(0, candidate_id=f"{node_id}-c0")
        assert (
            await post(api, f"/v1/nodes/{node_id}/candidates", {"actor": "ops", "candidates": [cand]}, method="PUT")
        )[0] == 200
        await report_ready(pool, node_id)
    # One pool opts into the runbook's tuned profile at approval; the other keeps the default.
    approve = {"actor": "ops", "reason": "pool opts into hugepages", "profile": "h200_1g_24c_64g"}
    assert (await post(api, "/v1/nodes/tuned/candidates/approve", approve))[0] == 200
    assert (await post(api, "/v1/nodes/plain/candidates/approve", {"actor": "ops", "reason": "default"}))[0] == 200
    placed = (await run_place(pool, accepted())).placed
    assert placed and placed.node_id == "plain" and placed.slots[0].profile == DEFAULT_PROFILE
    # The plain host is full; only the tuned pool is left, and it has no pages: why-not says which profile asked.
    u = (await run_place(pool, accepted())).unschedulable
    assert u is not None and u.filtered.get("hugepages_missing") == 1, u
    assert "1 GiB hugepages asked by profile h200_1g_24c_64g (64 per GPU)" in u.reason
    async with pool.acquire() as conn:
        await record_topology(scheduler_repositories(conn), topology_report("tuned", hugepages=64))
    placed = (await run_place(pool, accepted())).placed
    assert placed and placed.node_id == "tuned" and placed.slots[0].profile == "h200_1g_24c_64g"


async def test_errors_are_structured_and_leave_nothing_half_written(api, pool):
    async with pool.acquire() as conn:
        await synthetic.build(conn, slice_hosts=1)
    resp = await api.get("/v1/nodes", headers={"Authorization": "Bearer wrong"})
    assert resp.status == 401 and (await resp.json())["error"]["code"] == "unauthorized"
    resp = await api.post("/v1/nodes/n00001/drain", json={"actor": "ops", "reason": "x"}, headers=ADMIN_AUTH)
    assert resp.status == 400 and (await resp.json())["error"]["code"] == "idempotency_key_required"
    status, body = await post(api, "/v1/nodes/nope/drain", {"actor": "ops", "reason": "x"})
    assert status == 404 and body["error"]["code"] == "node_not_found"
    status, body = await post(api, "/v1/nodes/n00001/drain", {"actor": "ops"})
    assert status == 422 and body["error"]["details"]["errors"][0]["loc"] == "reason"
    # A batch whose second candidate would replace a slot under a live claim approves nothing.
    placed = (await run_place(pool, accepted())).placed
    held = placed.slots[0]
    batch = [
        candidate(9, candidate_id="new-c", gpu_pci_address="0000:77:00.0"),
        candidate(8, candidate_id="over", gpu_pci_address=held.gpu_pci_address),
    ]
    status, _ = await post(api, "/v1/nodes/n00001/candidates", {"actor": "ops", "candidates": batch}, method="PUT")
    assert status == 200
    status, body = await post(api, "/v1/nodes/n00001/candidates/approve", {"actor": "ops"})
    assert status == 409 and body["error"]["code"] == "slot_in_use"
    async with pool.acquire() as conn:
        assert await conn.fetchval("SELECT count(*) FROM node_resource_slots WHERE slot_id = 'new-c'") == 0
        held_status = await conn.fetchval("SELECT status FROM node_resource_slots WHERE slot_id = $1", held.slot_id)
        assert held_status == "reserved"
        assert await conn.fetchval("SELECT count(*) FROM admin_audit WHERE action = 'candidates.approve'") == 0


async def test_idempotency_key_replays_the_stored_response(api, pool):
    async with pool.acquire() as conn:
        await synthetic.build(conn, slice_hosts=1)
    body = {"actor": "ops", "reason": "rack swap", "maintenance": True}
    s1, r1 = await post(api, "/v1/nodes/n00001/drain", body, key="k-1")
    s2, r2 = await post(api, "/v1/nodes/n00001/drain", body, key="k-1")
    assert s1 == s2 == 200 and r1 == r2 and r1["node"]["drain_reason"] == "rack swap"
    s3, r3 = await post(api, "/v1/nodes/n00001/drain", {**body, "reason": "other"}, key="k-1")
    assert s3 == 409 and r3["error"]["code"] == "idempotency_conflict"
    async with pool.acquire() as conn:
        assert await conn.fetchval("SELECT count(*) FROM admin_audit WHERE action = 'node.drain'") == 1
    u = await run_place(pool, accepted())
    assert u.unschedulable.reason_code == "no_eligible_node" and u.unschedulable.filtered == {"maintenance": 1}
    status, undrained = await post(api, "/v1/nodes/n00001/undrain", {"actor": "ops", "reason": "done"})
    # Back from maintenance, its slots await the host's wipe proof (test_scheduler_maintenance_wipe.py).
    assert status == 200 and len(undrained["awaiting_wipe"]) == 8, undrained
    assert (await run_place(pool, accepted())).unschedulable


# Hand edits that bypass the approval API: the row still says 'available', placement must ignore it.
SLOT_EDITS = [
    "gpu_pci_address = NULL",
    "nvme_by_id = '/dev/nvme0n1'",
    "mac = NULL",
    "private_ip = NULL",
    "fabric_claim_mode = 'shared'",
    "fabric_vf_pci_address = ''",
    "nvme_evidence = NULL",
    "nvme_evidence = jsonb_set(nvme_evidence, '{mounted}', 'true')",
    "nvme_evidence = jsonb_set(nvme_evidence, '{mounted_children}', '[\"p1\"]')",
    "nvme_evidence = jsonb_set(nvme_evidence, '{signatures}', '[\"ext4\"]')",
    "nvme_evidence = jsonb_set(nvme_evidence, '{is_os_disk}', 'true')",
    "health_state = 'failed'",
]
NODE_EDITS = [
    "parity_failures = 1",
    "parity_failures = NULL",
    "draining = true",
    "maintenance = true",
    "schedulable = false",
    "mode = 'baremetal'",
    "maas_tags = '{gpuaas-profile-baremetal}'",
]


@pytest.mark.parametrize("edit", SLOT_EDITS)
async def test_placement_rechecks_each_slot_predicate(pool, edit):
    async with pool.acquire() as conn:
        await synthetic.build(conn, slice_hosts=1, slots_per_host=1)
        await conn.execute(f"UPDATE node_resource_slots SET {edit}")  # summary left stale on purpose
        assert await conn.fetchval("SELECT free_slots FROM nodes") == 1
    out = await run_place(pool, accepted())
    assert out.placed is None and out.unschedulable is not None


@pytest.mark.parametrize("edit", NODE_EDITS)
async def test_placement_rechecks_each_node_predicate(pool, edit):
    async with pool.acquire() as conn:
        await synthetic.build(conn, slice_hosts=1, slots_per_host=1)
        await conn.execute(f"UPDATE nodes SET {edit}")
    out = await run_place(pool, accepted())
    assert out.placed is None and out.unschedulable.reason_code == "no_eligible_node"


async def test_a_live_claim_on_an_available_row_is_respected(pool):
    async with pool.acquire() as conn:
        await synthetic.build(conn, slice_hosts=1, slots_per_host=1)
        await conn.execute(
            "INSERT INTO allocation_resource_claims (allocation_id, node_id, slot_id, claim_kind, status, "
            "fencing_epoch) VALUES ($1, 'n00001', 'n00001-s0', 'slot', 'held', 1)",
            uuid.uuid4(),
        )
    assert (await run_place(pool, accepted())).placed is None


async def test_duplicated_fabric_devices_are_exclusive(pool):
    async with pool.acquire() as conn:
        await synthetic.build(conn, slice_hosts=1, slots_per_host=2)
        await conn.execute("UPDATE node_resource_slots SET fabric_vf_pci_address = '0000:29:00.1'")
        await inv.refresh_nodes(conn)
    assert (await run_place(pool, accepted(2))).placed is None
    assert (await run_place(pool, accepted(1))).placed is not None
    assert (await run_place(pool, accepted(1))).placed is None


async def test_quota_is_checked_inside_the_claim_transaction(pool):
    async with pool.acquire() as conn:
        await synthetic.build(conn, slice_hosts=2)
        await conn.execute("INSERT INTO tenant_quotas VALUES ('small', 4, 'ops', 'trial')")
    assert (await run_place(pool, accepted(4, tenant="small"))).placed
    out = await run_place(pool, accepted(1, tenant="small"))
    assert out.unschedulable.reason_code == "quota_exceeded" and "4 of its 4" in out.unschedulable.reason
    assert (await run_place(pool, accepted(1, tenant="small"), PlacementPolicy())).placed is None
    assert (
        await run_place(
            pool,
            accepted(
                1,
                tenant="other",
            ),
            PlacementPolicy(default_tenant_gpu_quota=0),
        )
    ).unschedulable.reason_code == "quota_exceeded"


async def test_why_not_counts_are_complete_and_the_reason_precise(pool):
    async with pool.acquire() as conn:
        await synthetic.build(conn, slice_hosts=6, baremetal_hosts=1)
        await conn.execute("UPDATE nodes SET draining = true WHERE node_id = 'n00001'")
        await conn.execute("UPDATE nodes SET parity_failures = 2 WHERE node_id = 'n00002'")
        await conn.execute("UPDATE nodes SET region = 'eu' WHERE node_id = 'n00003'")
        # n00004..n00006: 4 free each, but two on each NUMA node (no topology-safe group of 4).
        await conn.execute(
            "UPDATE node_resource_slots SET status = 'cleanup_blocked' WHERE node_id IN "
            "('n00004', 'n00005', 'n00006') AND right(slot_id, 1) IN ('0', '1', '4', '5')"
        )
        await inv.refresh_nodes(conn)
    u = (await run_place(pool, accepted(4))).unschedulable
    assert u.reason_code == "topology"
    assert u.filtered == {"draining": 1, "parity": 1, "region": 1, "sku": 1, "topology": 3}
    assert u.free_gpus == 12 and u.reason.startswith("12 GPUs free but no node has 4 topology-safe slots")
    u = (await run_place(pool, accepted(8, "baremetal", sku="h200-sxm"))).unschedulable is None
    assert u


async def test_sql_candidate_order_matches_the_pure_ranking(pool):
    async with pool.acquire() as conn:
        await synthetic.build(conn, slice_hosts=30)
        await conn.execute("UPDATE node_resource_slots SET status = 'disabled' WHERE hashtext(slot_id) % 3 = 0")
        await inv.refresh_nodes(conn)
        rows = await conn.fetch("SELECT * FROM nodes WHERE free_slots > 0")
        pure_nodes = [inv.candidate_from_row(r) for r in rows]
        for gpus in (1, 2, 4, 8):
            req = inv.Request("gpu_slice", gpus, "default", "h200-sxm-slice")
            sql = [c async for c in inv.slice_candidates(conn, req, rank_classes(gpus), page=4)]
            ranked = rank_nodes(pure_nodes, gpus)
            # The SQL is a pre-filter: it may yield nodes the exact check then refuses, never miss one, never
            # repeat one, and keeps the documented order among those that fit.
            assert len({c.node_id for c in sql}) == len(sql), f"a node came twice for {gpus} GPUs"
            assert [c.node_id for c in sql if c in ranked] == [c.node_id for c in ranked]
            extras = [c for c in sql if c not in ranked]
            assert all(rank_nodes([c], gpus) == [] for c in extras), f"a node that fits {gpus} GPUs came unranked"
            if gpus < 8:  # a third of the slots are disabled: no host keeps 8 free, by construction
                assert ranked, f"the fixture leaves no node for {gpus} GPUs: the comparison would prove nothing"


async def _statuses(pool, slot_ids):
    async with pool.acquire() as conn:
        rows = await conn.fetch(
            "SELECT slot_id, status FROM node_resource_slots WHERE slot_id = ANY($1::text[])", slot_ids
        )
        return {r["status"] for r in rows}


def proofs(placed, verified=True, skip=0):
    return [m.WipeProof(device=s.nvme_by_id, method="blkdiscard", verified=verified) for s in placed.slots[skip:]]


async def test_release_with_wipe_proof_goes_through_cleanup_to_available(pool):
    async with pool.acquire() as conn:
        await synthetic.build(conn, slice_hosts=1)
    placed = await place_and_activate(pool)
    ids = [s.slot_id for s in placed.slots]
    async with pool.acquire() as conn, conn.transaction():
        await release_allocation(
            conn, placed.allocation_id, m.CleanupReport(required=True, verified=True, wipe_proofs=proofs(placed))
        )
    assert await _statuses(pool, ids) == {"available"}
    async with pool.acquire() as conn:
        path = [
            r["to_status"]
            for r in await conn.fetch("SELECT to_status FROM slot_transitions WHERE slot_id = $1 ORDER BY id", ids[0])
        ]
        assert path == ["provisioning", "active", "releasing", "cleanup", "available"]
        assert await conn.fetchval("SELECT free_slots FROM nodes") == 8


@pytest.mark.parametrize(
    "report",
    [
        m.CleanupReport(required=True, verified=False, reason="wipe not verified"),
        "missing_one",
        "unverified",
    ],
)
async def test_release_without_verified_proof_blocks_and_repair_returns_it(pool, api, report):
    async with pool.acquire() as conn:
        await synthetic.build(conn, slice_hosts=1)
    placed = await place_and_activate(pool)
    if report == "missing_one":
        report = m.CleanupReport(required=True, verified=True, wipe_proofs=proofs(placed, skip=1))
    elif report == "unverified":
        report = m.CleanupReport(required=True, verified=True, wipe_proofs=proofs(placed, verified=False))
    async with pool.acquire() as conn, conn.transaction():
        await release_allocation(conn, placed.allocation_id, report)
    blocked = placed.slots[0].slot_id
    assert "cleanup_blocked" in await _statuses(pool, [s.slot_id for s in placed.slots])
    assert await _statuses(pool, [blocked]) == {"cleanup_blocked"}
    # Disabling it would drop the mark that its disk still needs a verified wipe: refused, unchanged.
    status, body = await post(api, f"/v1/slots/{blocked}/disable", {"actor": "alice", "reason": "park it"})
    assert status == 409 and body["error"]["code"] == "slot_not_disableable"
    assert await _statuses(pool, [blocked]) == {"cleanup_blocked"}
    # The blocked slot is never placed again until repaired.
    for _ in range(7):
        p = (await run_place(pool, accepted(1))).placed
        assert p is None or p.slots[0].slot_id != blocked
    # Its disk may hold tenant data: the repair asks the host for the slot's wipe (blkdiscard here) and the slot
    # stays blocked until the host's own report proves it (issue 38; typed proofs are refused).
    status, body = await post(api, f"/v1/slots/{blocked}/repair", {"actor": "alice", "reason": "reuse it"})
    assert status == 200 and body["slot"]["status"] == "cleanup_blocked" and body["wipe_task"], body
    device = placed.slots[0].nvme_by_id
    proof = m.WipeProof(device=device, method="blkdiscard", verified=True, verification="zeros read back")
    report = m.NodeSlotWipeReported(
        task_id=body["wipe_task"],
        node_id=placed.node_id,
        outcomes=[m.SlotWipeOutcome(slot_id=blocked, device=device, proof=proof)],
    )
    async with pool.acquire() as conn, conn.transaction():
        subject = f"gpuaas.node.{placed.node_id}.report.slot_wipe"
        await slot_wipe.wipe_reported(
            scheduler_repositories(conn), OutboxWriter(conn, "scheduler", "scheduler"), subject, report
        )
    body = await (await api.get(f"/v1/slots/{blocked}", headers=ADMIN_AUTH)).json()
    assert body["slot"]["status"] == "available"
    assert body["transitions"][0]["actor"] == f"node:{placed.node_id}"
    # A repair that would put a mounted disk back in service is refused and changes nothing.
    status, body = await post(api, f"/v1/slots/{blocked}/disable", {"actor": "alice", "reason": "check"})
    assert status == 200
    # Asked again, it stays disabled with one transition, not two.
    status, again = await post(api, f"/v1/slots/{blocked}/disable", {"actor": "alice", "reason": "check"})
    assert status == 200 and again["slot"]["status"] == "disabled"
    async with pool.acquire() as conn:
        assert (
            await conn.fetchval(
                "SELECT count(*) FROM slot_transitions WHERE slot_id = $1 AND to_status = 'disabled'", blocked
            )
            == 1
        )
    status, body = await post(
        api,
        f"/v1/slots/{blocked}/repair",
        {"actor": "alice", "reason": "try", "nvme_evidence": {**CLEAN, "mounted": True}},
    )
    assert status == 409 and body["error"]["code"] == "repair_rejected"
    assert await _statuses(pool, [blocked]) == {"disabled"}


async def test_failed_provisioning_that_touched_the_disk_blocks_the_slots(pool):
    async with pool.acquire() as conn:
        await synthetic.build(conn, slice_hosts=1)
    touched = (await run_place(pool, accepted(2))).placed
    clean = (await run_place(pool, accepted(2))).placed
    async with pool.acquire() as conn, conn.transaction():
        await fail_allocation(conn, touched.allocation_id, True, "clone_failed: boom")
        await fail_allocation(conn, clean.allocation_id, False, "preflight_failed: no kvm")
    assert await _statuses(pool, [s.slot_id for s in touched.slots]) == {"cleanup_blocked"}
    assert await _statuses(pool, [s.slot_id for s in clean.slots]) == {"available"}
    async with pool.acquire() as conn:
        assert await conn.fetchval("SELECT count(*) FROM allocation_resource_claims WHERE status <> 'released'") == 0


async def test_the_watermark_keeps_the_last_clean_slice_hosts_whole(pool):
    # Which hosts may serve baremetal is the host mode's business (test_scheduler_host_modes.py); the
    # watermark only keeps clean slice hosts whole for 8-GPU slices and conversion.
    async with pool.acquire() as conn:
        await synthetic.build(conn, slice_hosts=3)
    policy = PlacementPolicy(clean_node_watermark=1)
    s1 = (await run_place(pool, accepted(4), policy)).placed
    s2 = (await run_place(pool, accepted(4), policy)).placed
    assert s1.node_id == s2.node_id == "n00001"
    s3 = (await run_place(pool, accepted(2), policy)).placed
    assert s3.node_id == "n00002"
    # Only one clean host is left: the watermark keeps it whole.
    u = (await run_place(pool, accepted(8), policy)).unschedulable
    assert u.reason_code == "clean_node_reserve" and u.filtered["clean_node_reserve"] == 1
    assert (await run_place(pool, accepted(1), policy)).placed.node_id == "n00002"
    assert (await run_place(pool, accepted(8), PlacementPolicy())).placed.node_id == "n00003"


def rediscovered(slot, candidate_id):
    """A candidate for the GPU of an existing slot, with that slot's own bindings and a clean disk."""
    return {
        "candidate_id": candidate_id,
        **{
            k: slot[k]
            for k in (
                "gpu_pci_address",
                "numa_node",
                "pcie_switch",
                "nvme_by_id",
                "fabric_claim_mode",
                "fabric_vf_pci_address",
                "mac",
                "private_ip",
                "ovs_bridge",
            )
        },
        "nvme_evidence": CLEAN,
    }


@pytest.mark.parametrize(
    "status",
    [
        "disabled",
        "available",
        "retired",
        "reserved",
        "provisioning",
        "active",
        "releasing",
        "cleanup",
        "cleanup_blocked",
    ],
)
async def test_approval_rewrites_an_idle_slot_and_refuses_any_other(api, pool, status):
    async with pool.acquire() as conn:
        await synthetic.build(conn, slice_hosts=1, slots_per_host=2)
        await conn.execute("UPDATE node_resource_slots SET status = $1 WHERE slot_id = 'n00001-s0'", status)
        before = dict(await conn.fetchrow("SELECT * FROM node_resource_slots WHERE slot_id = 'n00001-s0'"))
    status_code, _ = await post(
        api,
        "/v1/nodes/n00001/candidates",
        {"actor": "ops", "candidates": [rediscovered(before, "n00001-gpu0")]},
        method="PUT",
    )
    assert status_code == 200
    status_code, body = await post(api, "/v1/nodes/n00001/candidates/approve", {"actor": "ops", "reason": "again"})
    async with pool.acquire() as conn:
        after = dict(await conn.fetchrow("SELECT * FROM node_resource_slots WHERE slot_id = 'n00001-s0'"))
        logged = await conn.fetch("SELECT from_status, to_status FROM slot_transitions WHERE slot_id = 'n00001-s0'")
    if status in ("disabled", "available", "retired"):
        assert status_code == 200, body
        # A retired slot's disk may have served a baremetal tenant: back only through its host's wipe (issue 38).
        to = "awaiting_wipe" if status == "retired" else "available"
        [result] = body["results"]
        assert {k: result[k] for k in ("candidate_id", "slot_id", "status", "problems")} == {
            "candidate_id": "n00001-gpu0",
            "slot_id": "n00001-s0",
            "status": to,
            "problems": [],
        }
        assert after["status"] == to and after["candidate_id"] == "n00001-gpu0"
        assert after["generation"] == before["generation"] + 1
        assert [(r["from_status"], r["to_status"]) for r in logged] == [(status, to)]
    else:
        assert status_code == 409 and body["error"]["code"] == "slot_in_use"
        assert body["error"]["details"] == {"slot_id": "n00001-s0", "status": status}
        assert after == before and logged == []


async def test_the_approval_write_itself_refuses_a_slot_that_is_not_idle(pool):
    """Even a caller that read the slot wrong cannot overwrite one under a claim: the statement checks
    the rule on the row as it is, and writes nothing."""
    async with pool.acquire() as conn:
        await synthetic.build(conn, slice_hosts=1, slots_per_host=1)
        await conn.execute("UPDATE node_resource_slots SET status = 'reserved' WHERE slot_id = 'n00001-s0'")
        before = dict(await conn.fetchrow("SELECT * FROM node_resource_slots WHERE slot_id = 'n00001-s0'"))
        cand = {**rediscovered(before, "n00001-gpu0"), "ovs_port": None, "profile": before["profile"]}
        async with conn.transaction():
            with pytest.raises(InvalidSlotTransition, match="reserved"):
                await admin_slots.save_approval(
                    conn,
                    "n00001-s0",
                    "n00001",
                    cand,
                    previous="available",
                    status="available",
                    reason=None,
                    actor="ops",
                    log_reason=None,
                    problems=[],
                )
            assert dict(await conn.fetchrow("SELECT * FROM node_resource_slots WHERE slot_id = 'n00001-s0'")) == before
            assert await conn.fetchval("SELECT count(*) FROM slot_transitions") == 0


PREFLIGHT_GATE = [
    # (reports in order as (status, by system id?), outcome of the last, bucket or None when placeable)
    ([("passed", True)], "applied", None),
    ([("failed", True)], "applied", "preflight_failed"),
    ([("missing", True)], "applied", "preflight_missing"),
    ([("passed", True), ("failed", True)], "applied", "preflight_failed"),
    ([("failed", True), ("passed", False)], "applied", None),
]


@pytest.mark.parametrize(("reports", "outcome", "bucket"), PREFLIGHT_GATE)
async def test_slice_capability_is_gated_on_the_commissioning_preflight(pool, reports, outcome, bucket):
    """The machine maps to its node by maas_system_id (or the command's node id); the latest verdict gates."""
    async with pool.acquire() as conn:
        (node,) = await synthetic.build(conn, slice_hosts=1, slots_per_host=2)
        await conn.execute(
            "UPDATE nodes SET maas_system_id = 'sys-x', preflight_status = NULL WHERE node_id = $1", node
        )
        u = (await run_place(pool, accepted(gpus=1))).unschedulable
        assert u is not None and u.filtered.get("preflight_missing") == 1
        got = None
        for i, (status, by_sid) in enumerate(reports):
            ev = preflight_report(
                None if by_sid else node, status, system_id="sys-x" if by_sid else "sys-y", op=f"pf{i}"
            )
            got = await record_slice_preflight(scheduler_repositories(conn), ev)
        assert got == outcome
        assert await record_slice_preflight(scheduler_repositories(conn), ev) == "duplicate"
        kept = await conn.fetchval("SELECT count(*) FROM node_slice_preflight WHERE node_id = $1", node)
        assert kept == len(reports)
    result = await run_place(pool, accepted(gpus=1))
    if bucket is None:
        assert result.placed is not None
    else:
        assert result.unschedulable is not None and result.unschedulable.filtered.get(bucket) == 1, result


async def test_preflight_for_an_unknown_machine_is_kept_without_a_node_and_an_old_one_is_stale(pool):
    from datetime import timedelta

    async with pool.acquire() as conn:
        (node,) = await synthetic.build(conn, slice_hosts=1, slots_per_host=1)
        await conn.execute("UPDATE nodes SET maas_system_id = 'sys-x' WHERE node_id = $1", node)
        assert (
            await record_slice_preflight(
                scheduler_repositories(conn), preflight_report(None, "passed", system_id="nobody")
            )
            == "unknown_node"
        )
        assert await conn.fetchval("SELECT node_id FROM node_slice_preflight WHERE operation_id = 'pf-1'") is None
        late = preflight_report(None, "failed", system_id="sys-x", op="pf-old")
        late = late.model_copy(update={"reported_at": late.reported_at - timedelta(hours=1)})
        await record_slice_preflight(
            scheduler_repositories(conn), preflight_report(None, "passed", system_id="sys-x", op="pf-new")
        )
        assert await record_slice_preflight(scheduler_repositories(conn), late) == "stale"
        assert await conn.fetchval("SELECT preflight_status FROM nodes WHERE node_id = $1", node) == "passed"


async def test_an_end_that_contradicts_the_slots_never_leaves_them_in_use_without_a_claim(pool):
    """`released` saying the disk was never written while the slots are `active` (a reordered or forged
    event): before, the claims were freed and the slots stayed `active` with no claim (found by fuzzing). The
    log shows them provisioned under the allocation, so they are blocked for an operator with their claims
    ended; where the status and the log disagree (active, never logged provisioned), nothing moves and the end
    is retried."""
    async with pool.acquire() as conn:
        await synthetic.build(conn, slice_hosts=1)
    placed = (await run_place(pool, accepted(2))).placed
    async with pool.acquire() as conn, conn.transaction():
        for to, frm in (("provisioning", ("reserved",)), ("active", ("provisioning",))):
            await inv.set_slot_status(conn, placed.allocation_id, to, only_from=frm)
    ids = [s.slot_id for s in placed.slots]
    async with pool.acquire() as conn, conn.transaction():
        await release_allocation(conn, placed.allocation_id, m.CleanupReport(required=False, verified=False))
    assert await _statuses(pool, ids) == {"cleanup_blocked"}
    assert await _live_claims(pool, placed.allocation_id) == 0

    other = (await run_place(pool, accepted(2))).placed
    others = [s.slot_id for s in other.slots]
    async with pool.acquire() as conn:
        await conn.execute("UPDATE node_resource_slots SET status = 'active' WHERE slot_id = ANY($1::text[])", others)
    with pytest.raises(EndedOutOfOrder, match="claims kept"):
        async with pool.acquire() as conn, conn.transaction():
            await release_allocation(conn, other.allocation_id, m.CleanupReport(required=False, verified=False))
    assert await _statuses(pool, others) == {"active"}
    assert await _live_claims(pool, other.allocation_id) == len(others)


async def _live_claims(pool, allocation_id) -> int:
    async with pool.acquire() as conn:
        return await conn.fetchval(
            "SELECT count(*) FROM allocation_resource_claims WHERE allocation_id = $1 AND status = 'held'",
            allocation_id,
        )
