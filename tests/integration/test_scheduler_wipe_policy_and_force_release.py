"""Site wipe policy and admin force-release over real Postgres and the admin HTTP API (issue 12, deliverable 6):
the site's policy reaches the agent through placement, a released slot is reused only with a verified proof
made by it (none, or a wrong method, blocks it), a cleanup_blocked slot is repaired only with such a proof, and
force-release refuses while a VM may hold the devices unless forced, and then lands the slots in
cleanup_blocked, never available, and tells the allocator (an event valid against the contract)."""

from __future__ import annotations

import uuid

import pytest

from gpuaas_common.contract import messages as m
from gpuaas_common.contract.asyncapi import default_validator
from gpuaas_scheduler.adapters import synthetic
from gpuaas_scheduler.service_layer.handlers import fail_allocation, release_allocation

from .scheduler_db import (
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


async def _release(pool, placed, method, *, verified=True):
    proofs = [m.WipeProof(device=s.nvme_by_id, method=method, verified=verified) for s in placed.slots]
    async with pool.acquire() as conn, conn.transaction():
        await release_allocation(
            conn, placed.allocation_id, m.CleanupReport(required=True, verified=verified, wipe_proofs=proofs)
        )


async def _set_site(api, policy, region="default"):
    return await post(
        api,
        f"/v1/sites/{region}/wipe-policy",
        {"actor": "ops", "reason": "site standard", "destructive_wipe_policy": policy},
        method="PUT",
    )


# --- site wipe policy --------------------------------------------------------------------------------------


async def test_the_site_policy_is_recorded_on_its_slots_and_handed_to_the_agent(api, pool):
    async with pool.acquire() as conn:
        await synthetic.build(conn, slice_hosts=1)
    resp = await api.get("/v1/sites/default/wipe-policy", headers={"Authorization": "Bearer test-admin-token"})
    assert (await resp.json())["site_policy"] is None
    # Without a site policy, placement hands the agent each slot's approved policy.
    first = (await run_place(pool, accepted(1))).placed
    assert [s.wipe_policy for s in first.slots] == ["blkdiscard"]

    status, body = await _set_site(api, "crypto_erase")
    assert status == 200, body
    assert body["site_policy"]["destructive_wipe_policy"] == "crypto_erase"
    assert body["slots_in_use"] == [first.slots[0].slot_id]  # placed under blkdiscard: its release will block
    assert len(body["slots_updated"]) == 8
    rows = await slot_rows(pool, body["slots_updated"])
    assert {r["destructive_wipe_policy"] for r in rows.values()} == {"crypto_erase"}
    placed = (await run_place(pool, accepted(2))).placed
    assert [s.wipe_policy for s in placed.slots] == ["crypto_erase", "crypto_erase"]
    async with pool.acquire() as conn:
        audit = await conn.fetchrow("SELECT * FROM admin_audit WHERE action = 'site.wipe_policy'")
    assert (audit["actor"], audit["target"]) == ("ops", "default")

    # Only the runbook's policies: anything else is a structured 422 and nothing changes.
    status, body = await _set_site(api, "rm -rf")
    assert status == 422 and body["error"]["code"]
    resp = await api.get("/v1/sites/default/wipe-policy", headers={"Authorization": "Bearer test-admin-token"})
    assert (await resp.json())["site_policy"]["destructive_wipe_policy"] == "crypto_erase"


async def test_reuse_is_blocked_without_the_site_policys_proof(api, pool):
    async with pool.acquire() as conn:
        await synthetic.build(conn, slice_hosts=1)
    assert (await _set_site(api, "nvme_format"))[0] == 200

    # Violating: a verified blkdiscard is not the format the site requires.
    wrong = await place_and_activate(pool)
    await _release(pool, wrong, "blkdiscard")
    rows = await slot_rows(pool, [s.slot_id for s in wrong.slots])
    assert {(r["status"], r["health_state"]) for r in rows.values()} == {("cleanup_blocked", "failed")}
    assert all("site default's nvme_format policy" in r["status_reason"] for r in rows.values())

    # Violating: the right method, not verified.
    unverified = await place_and_activate(pool)
    await _release(pool, unverified, "nvme_format", verified=False)
    assert {r["status"] for r in (await slot_rows(pool, [s.slot_id for s in unverified.slots])).values()} == {
        "cleanup_blocked"
    }

    # Violating: no proof at all for the disks.
    missing = await place_and_activate(pool)
    async with pool.acquire() as conn, conn.transaction():
        await release_allocation(conn, missing.allocation_id, m.CleanupReport(required=True, verified=True))
    missing_rows = await slot_rows(pool, [s.slot_id for s in missing.slots])
    assert {r["status"] for r in missing_rows.values()} == {"cleanup_blocked"}
    assert all("no wipe proof" in r["status_reason"] for r in missing_rows.values())

    # The site's method, verified: back to available.
    good = await place_and_activate(pool)
    await _release(pool, good, "nvme_format")
    assert {r["status"] for r in (await slot_rows(pool, [s.slot_id for s in good.slots])).values()} == {"available"}


async def test_the_site_policy_wins_over_the_policy_recorded_at_approval(api, pool):
    async with pool.acquire() as conn:
        await synthetic.build(conn, slice_hosts=1)
    placed = await place_and_activate(pool)
    # A site policy set by hand in the table (no slot rewrite): release still judges by the site's.
    async with pool.acquire() as conn:
        await conn.execute(
            "INSERT INTO site_wipe_policies (region, destructive_wipe_policy, set_by, reason) "
            "VALUES ('default', 'crypto_erase', 'ops', 'test')"
        )
    await _release(pool, placed, "blkdiscard")
    rows = await slot_rows(pool, [s.slot_id for s in placed.slots])
    assert {r["status"] for r in rows.values()} == {"cleanup_blocked"}
    assert all("crypto_erase" in r["status_reason"] for r in rows.values())


async def test_approval_takes_the_site_policy_and_refuses_another(api, pool):
    status, _ = await post(
        api,
        "/v1/nodes",
        {"actor": "ops", "node_id": "h1", "kind": "slice_host", "hostname": "h1", "sku": "h200-sxm-slice"},
    )
    assert status == 200
    status, _ = await post(
        api, "/v1/nodes/h1/candidates", {"actor": "ops", "candidates": [candidate(0), candidate(1)]}, method="PUT"
    )
    assert status == 200
    await report_ready(pool, "h1")
    assert (await _set_site(api, "nvme_format"))[0] == 200
    status, body = await post(api, "/v1/nodes/h1/candidates/approve", {"actor": "ops", "candidate_ids": ["h1-c0"]})
    assert status == 200, body
    assert (await slot_rows(pool, ["h1-c0"]))["h1-c0"]["destructive_wipe_policy"] == "nvme_format"
    # Violating: one slot asking for a weaker wipe than its site's is refused, nothing written.
    status, body = await post(
        api,
        "/v1/nodes/h1/candidates/approve",
        {"actor": "ops", "candidate_ids": ["h1-c1"], "destructive_wipe_policy": "blkdiscard"},
    )
    assert status == 409 and body["error"]["code"] == "wipe_policy_conflicts_with_site"
    assert await slot_rows(pool, ["h1-c1"]) == {}


async def test_repairing_a_cleanup_blocked_slot_needs_the_sites_proof(api, pool):
    async with pool.acquire() as conn:
        await synthetic.build(conn, slice_hosts=1)
    assert (await _set_site(api, "crypto_erase"))[0] == 200
    placed = await place_and_activate(pool)
    await _release(pool, placed, "zero_fill")
    slot = placed.slots[0]
    assert (await slot_rows(pool, [slot.slot_id]))[slot.slot_id]["status"] == "cleanup_blocked"
    proof = {
        "device": slot.nvme_by_id,
        "method": "crypto_erase",
        "verified": True,
        "verification": "nvme sanitize --sanact=4 then 64 sampled blocks changed",
    }
    # Nobody types a proof (issue 38): refused whatever it says, and nothing changes.
    for typed in (proof, {**proof, "method": "blkdiscard"}):
        body = {"actor": "alice", "reason": "wiped by infra", "wipe_proof": typed}
        status, answer = await post(api, f"/v1/slots/{slot.slot_id}/repair", body)
        assert status == 422 and answer["error"]["code"] == "typed_wipe_proof_refused", answer
        assert (await slot_rows(pool, [slot.slot_id]))[slot.slot_id]["status"] == "cleanup_blocked"
    # The repair asks the slot's host for the site's wipe; the slot stays blocked until the host proves it.
    status, answer = await post(api, f"/v1/slots/{slot.slot_id}/repair", {"actor": "alice", "reason": "reuse"})
    assert status == 200 and answer["slot"]["status"] == "cleanup_blocked" and answer["wipe_task"], answer
    validator = default_validator()
    async with pool.acquire() as conn:
        rows = await conn.fetch("SELECT subject, body FROM outbox WHERE subject LIKE 'gpuaas.node.%.tasks.%'")
    tasks = [validator.validate(r["subject"], bytes(r["body"])) for r in rows]
    [wipe] = [t["payload"] for t in tasks if t["type"] == "slice.slot_wipe"]
    assert wipe["slots"] == [{"slot_id": slot.slot_id, "nvme_by_id": slot.nvme_by_id, "wipe_policy": "crypto_erase"}]


# --- force-release -----------------------------------------------------------------------------------------


async def _outbox(pool, subject):
    async with pool.acquire() as conn:
        rows = await conn.fetch("SELECT subject, body FROM outbox WHERE subject = $1 ORDER BY id", subject)
    validator = default_validator()
    return [validator.validate(r["subject"], bytes(r["body"]))["payload"] for r in rows]


async def test_force_release_refuses_while_the_vm_may_hold_the_devices(api, pool):
    async with pool.acquire() as conn:
        await synthetic.build(conn, slice_hosts=1)
    placed = await place_and_activate(pool)
    ids = [s.slot_id for s in placed.slots]
    path = f"/v1/allocations/{placed.allocation_id}/force-release"
    status, body = await post(api, path, {"actor": "ops", "reason": "agent gone"})
    assert status == 409 and body["error"]["code"] == "vm_may_hold_devices"
    assert all("is releasing" in h for h in body["error"]["details"]["holders"])  # release never answered
    # Nothing changed: claims held, slots where they were, no event.
    assert {r["status"] for r in (await slot_rows(pool, ids)).values()} == {"releasing"}
    async with pool.acquire() as conn:
        held = await conn.fetchval(
            "SELECT count(*) FROM allocation_resource_claims WHERE allocation_id = $1 AND status = 'held'",
            placed.allocation_id,
        )
    assert held == len(ids)
    assert await _outbox(pool, "gpuaas.scheduler.placement.force_released") == []
    # A refusal is audited like every admin request.
    async with pool.acquire() as conn:
        assert (
            await conn.fetchval(
                "SELECT count(*) FROM admin_requests WHERE status = 409 AND error_code = 'vm_may_hold_devices'"
            )
            >= 1
        )


async def test_forced_release_lands_the_slots_in_cleanup_blocked_and_tells_the_allocator(api, pool):
    async with pool.acquire() as conn:
        await synthetic.build(conn, slice_hosts=1)
    placed = await place_and_activate(pool)
    ids = [s.slot_id for s in placed.slots]
    path = f"/v1/allocations/{placed.allocation_id}/force-release"
    key = uuid.uuid4().hex
    status, body = await post(api, path, {"actor": "ops", "reason": "host unreachable", "force": True}, key=key)
    assert status == 200, body
    assert body["slots"] == {i: "cleanup_blocked" for i in ids} and body["claims_released"] == len(ids)
    rows = await slot_rows(pool, ids)
    assert {(r["status"], r["health_state"]) for r in rows.values()} == {("cleanup_blocked", "failed")}
    assert all("force-released by ops" in r["status_reason"] for r in rows.values())
    # Freed claims: the slots still never place (cleanup_blocked), and nothing is available that was forced.
    for _ in range(6):
        p = (await run_place(pool, accepted(1))).placed
        assert p is None or p.slots[0].slot_id not in ids
    [event] = await _outbox(pool, "gpuaas.scheduler.placement.force_released")
    assert (event["allocation_id"], event["forced"], sorted(event["slot_ids"])) == (
        str(placed.allocation_id),
        True,
        sorted(ids),
    )
    # The same request again replays its answer; a new one finds nothing left to free.
    status, again = await post(api, path, {"actor": "ops", "reason": "host unreachable", "force": True}, key=key)
    assert status == 200 and again == body
    status, body = await post(api, path, {"actor": "ops", "reason": "again", "force": True})
    assert status == 404 and body["error"]["code"] == "no_live_claims"
    assert len(await _outbox(pool, "gpuaas.scheduler.placement.force_released")) == 1
    # The allocator's answer (allocation.failed, cleanup required) leaves the slots blocked.
    from gpuaas_scheduler.service_layer.handlers import fail_allocation

    async with pool.acquire() as conn, conn.transaction():
        await fail_allocation(conn, placed.allocation_id, True, "force_released: host unreachable")
    assert {r["status"] for r in (await slot_rows(pool, ids)).values()} == {"cleanup_blocked"}


async def test_a_stale_claim_is_released_without_force_and_its_slot_is_never_made_available(api, pool):
    async with pool.acquire() as conn:
        await synthetic.build(conn, slice_hosts=1)
    placed = await place_and_activate(pool)
    ids = [s.slot_id for s in placed.slots]
    # The scheduler already saw the end of the VM (cleanup), but the claim was left behind.
    async with pool.acquire() as conn:
        await conn.execute("UPDATE node_resource_slots SET status = 'cleanup' WHERE slot_id = ANY($1::text[])", ids)
    status, body = await post(
        api, f"/v1/allocations/{placed.allocation_id}/force-release", {"actor": "ops", "reason": "stale claim"}
    )
    assert status == 200 and body["holders"] == [] and body["forced"] is False
    assert {r["status"] for r in (await slot_rows(pool, ids)).values()} == {"cleanup_blocked"}


async def test_force_release_of_a_whole_node_claim_drains_the_node(api, pool):
    async with pool.acquire() as conn:
        await synthetic.build(conn, slice_hosts=0, baremetal_hosts=1)
    placed = (await run_place(pool, accepted(8, shape="baremetal", sku="h200-sxm"))).placed
    assert placed is not None and placed.claim_mode == "node_exclusive"
    path = f"/v1/allocations/{placed.allocation_id}/force-release"
    status, body = await post(api, path, {"actor": "ops", "reason": "tenant gone"})
    assert status == 409 and "held whole" in body["error"]["details"]["holders"][0]
    status, body = await post(api, path, {"actor": "ops", "reason": "tenant gone", "force": True})
    assert status == 200 and body["drained_nodes"] == [placed.node_id]
    async with pool.acquire() as conn:
        node = await conn.fetchrow("SELECT draining, drain_reason FROM nodes WHERE node_id = $1", placed.node_id)
    assert node["draining"] and "force-released" in node["drain_reason"]


async def test_a_node_held_whole_is_placed_with_its_sites_policy_for_the_machines_erase(api, pool):
    # The allocator derives the MAAS erase of the machine's release from it: the default without a site policy.
    async with pool.acquire() as conn:
        await synthetic.build(conn, slice_hosts=0, baremetal_hosts=1)
    first = (await run_place(pool, accepted(8, shape="baremetal", sku="h200-sxm"))).placed
    assert first is not None and (first.claim_mode, first.wipe_policy) == ("node_exclusive", "blkdiscard")
    await _release(pool, first, "blkdiscard")
    assert (await _set_site(api, "crypto_erase"))[0] == 200
    second = (await run_place(pool, accepted(8, shape="baremetal", sku="h200-sxm"))).placed
    assert second is not None and (second.node_id, second.wipe_policy) == (first.node_id, "crypto_erase")

    # Its MAAS erase failed (the allocator fails the allocation, cleanup required): the node is drained, so nothing
    # is placed on it again until ops have seen it.
    async with pool.acquire() as conn, conn.transaction():
        await fail_allocation(conn, second.allocation_id, True, "disk_erase_failed: MAAS Failed disk erasing")
    async with pool.acquire() as conn:
        node = await conn.fetchrow("SELECT draining, drain_reason FROM nodes WHERE node_id = $1", first.node_id)
    assert node["draining"] and "disk_erase_failed" in node["drain_reason"]
    assert (await run_place(pool, accepted(8, shape="baremetal", sku="h200-sxm"))).placed is None


async def test_force_release_validates_its_input(api, pool):
    status, body = await post(api, "/v1/allocations/not-a-uuid/force-release", {"actor": "ops", "reason": "x"})
    assert status == 422 and body["error"]["code"] == "invalid_allocation_id"
    status, body = await post(api, f"/v1/allocations/{uuid.uuid4()}/force-release", {"actor": "ops", "reason": "x"})
    assert status == 404 and body["error"]["code"] == "no_live_claims"
