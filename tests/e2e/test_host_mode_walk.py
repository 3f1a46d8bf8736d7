"""One host walks slice → drained → baremetal allocation → release → converting → the scheduler's walk back
(slice-host redeploy through MAAS, rediscovery, parity, re-approval of the slots it had, with no hands) → slice
allocation, through the five service processes, the MAAS simulator and the simulated host's own agent; at every
step in between a slice request is unschedulable and the why-not names the host's mode. The stack's own capacity
is earned through discovery too: seeded as candidates, discovered by the agent, approved through the scheduler's
admin API as `gpuaas-dev`."""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import datetime
from typing import Any

import pytest

from gpuaas_dev.stack import Stack
from gpuaas_dev.testing.waiting import eventually

from .conftest import maas_sim
from .conftest import scheduler_admin as admin
from .conftest import scheduler_ok as ok

pytestmark = pytest.mark.e2e

HOST = "slice-01"
SLICE_HOST_PROFILE = "h200-slice-host"
# MAAS answers the walk's deploy with a conflict (nothing done) until the test clears this fault.
HOLD_DEPLOY = {"kind": "conflict", "op": "deploy", "count": 100000, "retry_after": 0.2}
TAGS = ["gpuaas-profile-slice-vm", "gpuaas-profile-baremetal"]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    # One slice host and no baremetal-only host: every placement below can only land on HOST, so an
    # unschedulable answer is about HOST alone.
    s = Stack(tmp_path_factory.mktemp("stack"), slice_hosts=1, slots_per_host=4, baremetal_hosts=0)
    s.start()
    yield s
    s.stop()


async def node(stack: Stack) -> dict[str, Any]:
    return (await ok(stack, "GET", f"/v1/nodes/{HOST}"))["node"]


async def assert_no_slice_lands(portal, mode: str) -> None:
    alloc = await portal.request("gpu_slice", gpus=1)
    u = (await portal.spy.wait_type("allocation.unschedulable", allocation_id=alloc, timeout=60))["payload"]
    assert u["reason_code"] == "no_eligible_node", u
    assert u["filtered"] == {"host_mode": 1}, f"host {mode}: {u}"
    assert not portal.spy.of_type("allocation.placed", allocation_id=alloc)


async def slice_round_trip(portal) -> str:
    alloc = await portal.request("gpu_slice", gpus=2)
    active = await portal.wait_state(alloc, "active", timeout=90)
    await portal.release(alloc)
    released = await portal.wait_state(alloc, "released", timeout=90)
    assert released["payload"]["cleanup"]["verified"] is True
    return active["payload"]["node_id"]


async def test_the_stack_earned_its_slots_through_discovery_parity_and_a_recorded_approval(stack, db):
    slots = await db.fetch("SELECT slot_id, status, approved_by, nvme_evidence FROM scheduler.node_resource_slots")
    assert len(slots) == 4 and {s["status"] for s in slots} == {"available"}
    assert {s["approved_by"] for s in slots} == {"gpuaas-dev"}
    assert all(s["nvme_evidence"] is not None for s in slots)  # the agent's disk evidence, not the seed's
    # Every slot is a discovered candidate: keyed by the GPU discovery found, reported by the agent.
    sources = await db.fetch("SELECT source, approved_slot_id FROM scheduler.candidate_slots WHERE node_id = $1", HOST)
    approved = {c["approved_slot_id"] for c in sources if c["approved_slot_id"]}
    assert approved == {s["slot_id"] for s in slots}
    assert {c["source"] for c in sources} == {"node-agent"}
    logged = await db.fetch(
        "SELECT actor, from_status, to_status FROM scheduler.slot_transitions WHERE slot_id = ANY($1::text[])",
        [s["slot_id"] for s in slots],
    )
    assert {(r["actor"], r["from_status"], r["to_status"]) for r in logged} == {("gpuaas-dev", None, "available")}
    audit = await db.fetchrow(
        "SELECT actor, reason FROM scheduler.admin_audit WHERE action = 'candidates.approve' AND target = $1", HOST
    )
    assert audit["actor"] == "gpuaas-dev" and "discovered" in audit["reason"]
    first = await db.fetchrow(
        "SELECT actor, to_mode FROM scheduler.node_mode_history WHERE node_id = $1 ORDER BY id LIMIT 1", HOST
    )
    assert (first["actor"], first["to_mode"]) == ("fleet-seed", "slice")
    n = await node(stack)
    assert n["parity_failures"] == 0 and n["topology_reported_at"] is not None


async def test_one_host_walks_from_slices_to_baremetal_and_back(stack, portal, db):
    # slice: it serves slices.
    assert await slice_round_trip(portal) == HOST

    # Ops make it convertible (MAAS tags) and drain it: from here no slice lands until it is re-approved.
    current = await node(stack)
    await ok(
        stack,
        "POST",
        "/v1/nodes",
        {
            "actor": "ops",
            "node_id": HOST,
            "kind": "slice_host",
            "hostname": current["hostname"],
            "sku": current["sku"],
            "maas_system_id": current["maas_system_id"],
            "maas_tags": TAGS,
        },
    )
    await ok(stack, "POST", f"/v1/nodes/{HOST}/mode", {"actor": "ops", "mode": "drained", "reason": "tenant wants it"})
    await assert_no_slice_lands(portal, "drained")
    # The rules: no baremetal while its slots still promise GPUs and disks to slices.
    status, refused = await admin(
        stack, "POST", f"/v1/nodes/{HOST}/mode", {"actor": "ops", "mode": "baremetal", "reason": "too early"}
    )
    assert status == 409 and any("not retired" in p for p in refused["error"]["details"]["problems"]), refused
    await ok(stack, "POST", f"/v1/nodes/{HOST}/slots/retire", {"actor": "ops", "reason": "host goes baremetal"})
    await ok(stack, "POST", f"/v1/nodes/{HOST}/mode", {"actor": "ops", "mode": "baremetal", "reason": "tenant"})
    # Leaving the modes that keep slices: the host's agent is asked to release its approved devices, and does.
    left = await db.fetchval(
        "SELECT detail->>'vfio_task' FROM scheduler.admin_audit WHERE action = 'node.mode' AND target = $1 "
        "AND detail->>'to' = 'baremetal' ORDER BY id DESC LIMIT 1",
        HOST,
    )
    assert left, "no VFIO unbind asked on leaving slice mode"
    assert (await portal.spy.wait_type("slice.vfio_apply", task_id=left))["payload"]["action"] == "unbind"
    await portal.spy.wait_type("node.parity_reported", task_id=left, timeout=60)
    await assert_no_slice_lands(portal, "baremetal")

    # baremetal allocation: MAAS deploys the host and it enrols as a baremetal host.
    bm = await portal.request("baremetal", gpus=8)
    placed = await portal.wait_state(bm, "placed")
    assert placed["payload"]["node_id"] == HOST and placed["payload"]["claim_mode"] == "node_exclusive"
    await portal.wait_state(bm, "active", timeout=120)
    system_id = placed["payload"]["maas_system_id"]
    assert (await maas_sim(stack, "GET", f"/_sim/machines/{system_id}"))["status_name"] == "Deployed"
    await assert_no_slice_lands(portal, "baremetal, deployed")

    # release: MAAS takes it back; the host returns converting with parity and topology unknown. Its walk back
    # starts with a slice-host deploy, which MAAS refuses (a conflict) until the test lets it through: while the
    # walk cannot have left `redeploy_requested`, a slice request must find the host unschedulable.
    binds_before = len(portal.spy.of_type("slice.vfio_apply", node_id=HOST, action="bind"))
    held = (await maas_sim(stack, "POST", "/_sim/faults", HOLD_DEPLOY | {"system_id": system_id}))["faults"][0]
    await portal.release(bm)
    await portal.wait_state(bm, "released", timeout=120)

    async def converting() -> dict[str, Any] | None:
        n = await node(stack)
        return n if n["mode"] == "converting" else None

    back = await eventually(converting, timeout=60, what=f"{HOST} converting")
    assert back["mode_changed_by"] == "scheduler" and str(bm) in back["mode_reason"]
    # Nothing learnt before the deployment survives the reset.
    assert back["evidence_reset_at"] is not None
    reset = datetime.fromisoformat(back["evidence_reset_at"])
    for reported in (back["topology_reported_at"], back["parity_checked_at"]):
        assert reported is None or datetime.fromisoformat(reported) > reset, back

    async def deploy_refused() -> dict[str, Any] | None:
        faults = (await maas_sim(stack, "GET", "/_sim/faults"))["faults"]
        return next((f for f in faults if f["id"] == held["id"] and f["fired"] > 0), None)

    await eventually(deploy_refused, timeout=90, what="the walk's slice-host deploy reaching MAAS")
    walk = (await ok(stack, "GET", f"/v1/nodes/{HOST}"))["walks"][0]
    assert walk["state"] == "redeploy_requested" and walk["profile"] == SLICE_HOST_PROFILE, walk
    await assert_no_slice_lands(portal, "converting")
    await maas_sim(stack, "DELETE", f"/_sim/faults?id={held['id']}")

    # No hands from here: the scheduler's walk redeploys the host with the slice-host profile (its agent comes
    # back with the user that deploy carried), asks it for a rediscovery, and on a passing parity run re-approves
    # the slots the host had when it left slice mode, which returns it to slice mode.
    async def walked() -> dict[str, Any] | None:
        doc = await ok(stack, "GET", f"/v1/nodes/{HOST}")
        return doc if doc["walks"] and doc["walks"][0]["state"] in ("reapproved", "stopped") else None

    doc = await eventually(walked, timeout=240, what=f"{HOST}'s walk back to slice mode")
    walk = doc["walks"][0]
    assert walk["state"] == "reapproved", walk
    assert [(st["from_state"], st["to_state"]) for st in walk["steps"]] == [
        (None, "redeploy_requested"),
        ("redeploy_requested", "deployed"),
        ("deployed", "rediscovered"),
        ("rediscovered", "parity_passed"),
        ("parity_passed", "reapproved"),
    ], walk
    assert doc["node"]["mode"] == "slice" and doc["node"]["parity_failures"] == 0
    # The deploy went through the gateway with the slice-host profile: the machine holds that deploy's user-data,
    # which carries the host's slice identity and no tenant's enrolment file.
    machine = await maas_sim(stack, "GET", f"/_sim/machines/{system_id}")
    assert machine["status_name"] == "Deployed"
    user_data = machine["_sim"]["last_deploy"]["user_data"]
    assert "/etc/gpuaas/node-agent.env" not in user_data and "GPUAAS_ROLE=slice_host" in user_data
    # The rediscovery was the walk's ask, answered, on the node's history like an operator's. (It may read failed:
    # the stack's hosts have GPUs without a disk, which discovery names as blockers; the walk asks only for the
    # slots the host had.)
    ask = next(a for a in doc["actions"] if a["action_id"] == walk["rediscover_action_id"])
    assert (ask["kind"], ask["actor"]) == ("rediscover", "scheduler") and ask["status"] != "requested", ask
    # Exactly the slots it had when it left slice mode are back, approved by the walk.
    slots = await db.fetch(
        "SELECT slot_id, status, approved_by FROM scheduler.node_resource_slots WHERE node_id = $1", HOST
    )
    assert sorted(s["slot_id"] for s in slots) == sorted(walk["slots"]) and len(slots) == 4
    assert {s["approved_by"] for s in slots} == {"scheduler"}

    # A baremetal tenant had every disk (issue 38): re-approved awaiting the host's own wipe proof, which the
    # scheduler asked for (slice.slot_wipe) and the host's agent answered on its own report subject. Each slot is
    # available only through that proof, judged against the site's policy.
    async def wiped() -> list[Any] | None:
        rows = await db.fetch(
            "SELECT slot_id, status FROM scheduler.node_resource_slots WHERE node_id = $1 AND status = 'available'",
            HOST,
        )
        return rows if len(rows) == 4 else None

    await eventually(wiped, timeout=120, what=f"{HOST}'s slots freed by its wipe proofs")
    for s in slots:
        moves = await db.fetch(
            "SELECT from_status, to_status, actor, detail FROM scheduler.slot_transitions WHERE slot_id = $1 "
            "ORDER BY id",
            s["slot_id"],
        )
        pairs = [(r["from_status"], r["to_status"]) for r in moves]
        assert ("retired", "awaiting_wipe") in pairs and pairs[-1] == ("awaiting_wipe", "available"), pairs
        freed = moves[-1]
        assert freed["actor"] == f"node:{HOST}", freed
        detail = json.loads(freed["detail"]) if isinstance(freed["detail"], str) else freed["detail"]
        assert detail["proof"]["verified"] is True and detail["proof"]["signatures"] == [], detail
        task = await portal.spy.wait_type("slice.slot_wipe", task_id=detail["wipe_task"], timeout=5)
        assert s["slot_id"] in {w["slot_id"] for w in task["payload"]["slots"]}
        report = await portal.spy.wait_type("node.slot_wipe_reported", task_id=detail["wipe_task"], timeout=5)
        assert report["payload"]["node_id"] == HOST

    # Back in slice mode: the host binds exactly the re-approved slots' devices, and parity checks that set.
    async def rebound() -> dict[str, Any] | None:
        binds = portal.spy.of_type("slice.vfio_apply", node_id=HOST, action="bind")
        return binds[-1]["payload"] if len(binds) > binds_before else None

    bind = await eventually(rebound, timeout=60, what=f"{HOST}'s VFIO binding on re-entering slice mode")
    assert sorted(s["slot_id"] for s in bind["slots"]) == sorted(walk["slots"]), bind
    after = (await portal.spy.wait_type("node.parity_reported", task_id=bind["task_id"], timeout=60))["payload"]
    vfio = next(c for c in after["checks"] if c["check"] == "vfio_binding")
    assert vfio["status"] == "PASS", vfio

    # slice allocation: it lands on the host again.
    assert await slice_round_trip(portal) == HOST
    history = await db.fetch(
        "SELECT from_mode, to_mode, actor FROM scheduler.node_mode_history WHERE node_id = $1 ORDER BY id", HOST
    )
    assert [(h["from_mode"], h["to_mode"], h["actor"]) for h in history] == [
        (None, "slice", "fleet-seed"),
        ("slice", "drained", "ops"),
        ("drained", "baremetal", "ops"),
        ("baremetal", "converting", "scheduler"),
        ("converting", "slice", "scheduler"),
    ]
