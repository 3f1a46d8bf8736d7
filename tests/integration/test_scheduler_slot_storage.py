"""Slot storage metadata, the wipe policy a released slot's proof must satisfy, and slot health `failed` on
failed cleanup (issue 12, deliverable 6; slice-node-bootstrap runbook: storage_ownership=slice,
storage_mode=slice, destructive_wipe_policy=blkdiscard, storage_identity_kind=nvme_wwn_by_id; "failed cleanup
now marks the slot health state as failed")."""

from __future__ import annotations

import pytest

from gpuaas_common.contract import messages as m
from gpuaas_scheduler.adapters import inventory as inv
from gpuaas_scheduler.adapters import synthetic
from gpuaas_scheduler.service_layer.handlers import fail_allocation, release_allocation

from .scheduler_db import (
    ADMIN_AUTH,
    accepted,
    admin_client,
    candidate,
    place_and_activate,
    post,
    report_ready,
    run_place,
    scheduler_pool,
    slot_rows,
)


@pytest.fixture
async def pool(fresh_db):
    async with scheduler_pool(fresh_db) as p:
        yield p


@pytest.fixture
async def api(pool):
    async with admin_client(pool) as client:
        yield client


async def test_approval_records_the_storage_metadata_of_the_runbook(api, pool):
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
    status, _ = await post(
        api, "/v1/nodes/h1/candidates", {"actor": "ops", "candidates": [candidate(0), candidate(1)]}, method="PUT"
    )
    assert status == 200
    await report_ready(pool, "h1")
    status, body = await post(
        api, "/v1/nodes/h1/candidates/approve", {"actor": "ops", "candidate_ids": ["h1-c0"], "reason": "site default"}
    )
    assert status == 200
    status, body = await post(
        api,
        "/v1/nodes/h1/candidates/approve",
        {"actor": "ops", "candidate_ids": ["h1-c1"], "destructive_wipe_policy": "nvme_format"},
    )
    assert status == 200
    resp = await api.get("/v1/nodes/h1/slots", headers=ADMIN_AUTH)
    slots = {s["slot_id"]: s for s in (await resp.json())["slots"]}
    storage = ("storage_ownership", "storage_mode", "destructive_wipe_policy", "storage_identity_kind")
    assert [slots["h1-c0"][k] for k in storage] == ["slice", "slice", "blkdiscard", "nvme_wwn_by_id"]
    assert slots["h1-c1"]["destructive_wipe_policy"] == "nvme_format"
    # Only the runbook's policies exist: anything else is a structured 422, nothing written.
    status, body = await post(
        api,
        "/v1/nodes/h1/candidates/approve",
        {"actor": "ops", "candidate_ids": ["h1-c1"], "destructive_wipe_policy": "rm -rf"},
    )
    assert status == 422
    assert (await slot_rows(pool, ["h1-c1"]))["h1-c1"]["destructive_wipe_policy"] == "nvme_format"


async def test_reuse_needs_a_proof_made_by_the_slots_own_wipe_policy(pool):
    async with pool.acquire() as conn:
        await synthetic.build(conn, slice_hosts=1)
        await conn.execute("UPDATE node_resource_slots SET destructive_wipe_policy = 'nvme_format'")
    placed = await place_and_activate(pool)
    ids = [s.slot_id for s in placed.slots]
    # A verified, clean blkdiscard proof is not the format this site requires: the slots stay blocked.
    discard = [m.WipeProof(device=s.nvme_by_id, method="blkdiscard", verified=True) for s in placed.slots]
    async with pool.acquire() as conn, conn.transaction():
        await release_allocation(
            conn, placed.allocation_id, m.CleanupReport(required=True, verified=True, wipe_proofs=discard)
        )
    rows = await slot_rows(pool, ids)
    assert {r["status"] for r in rows.values()} == {"cleanup_blocked"}
    assert all("nvme_format policy" in r["status_reason"] for r in rows.values())
    assert {r["health_state"] for r in rows.values()} == {"failed"}

    placed = await place_and_activate(pool)
    formatted = [m.WipeProof(device=s.nvme_by_id, method="nvme_format", verified=True) for s in placed.slots]
    async with pool.acquire() as conn, conn.transaction():
        await release_allocation(
            conn, placed.allocation_id, m.CleanupReport(required=True, verified=True, wipe_proofs=formatted)
        )
    assert {r["status"] for r in (await slot_rows(pool, [s.slot_id for s in placed.slots])).values()} == {"available"}


async def test_failed_cleanup_marks_slot_health_failed_not_degraded(pool):
    async with pool.acquire() as conn:
        await synthetic.build(conn, slice_hosts=1)
    touched = (await run_place(pool, accepted(2))).placed
    async with pool.acquire() as conn, conn.transaction():
        await fail_allocation(conn, touched.allocation_id, True, "task_deadline_passed: host silent")
    rows = await slot_rows(pool, [s.slot_id for s in touched.slots])
    assert {(r["status"], r["health_state"]) for r in rows.values()} == {("cleanup_blocked", "failed")}

    released = await place_and_activate(pool)
    async with pool.acquire() as conn, conn.transaction():
        await release_allocation(
            conn, released.allocation_id, m.CleanupReport(required=True, verified=False, reason="wipe not verified")
        )
    rows = await slot_rows(pool, [s.slot_id for s in released.slots])
    assert {(r["status"], r["health_state"]) for r in rows.values()} == {("cleanup_blocked", "failed")}
