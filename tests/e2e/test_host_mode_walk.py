"""One host walks slice → drained → baremetal allocation → release → converting → rediscovery + parity +
re-approval → slice allocation, through the five service processes, the MAAS simulator and the simulated
host's own agent; at every step in between a slice request is unschedulable and the why-not names the
host's mode. The stack's own capacity is earned the same way: seeded as candidates, discovered by the
agent, approved through the scheduler's admin API as `gpuaas-dev`."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from datetime import datetime, timedelta
from typing import Any

import aiohttp
import nats
import pytest

from gpuaas_common.contract import Envelope, utcnow
from gpuaas_dev.stack import Stack
from gpuaas_dev.testing.waiting import eventually

from .conftest import maas_sim

pytestmark = pytest.mark.e2e

HOST = "slice-01"
TAGS = ["gpuaas-profile-slice-vm", "gpuaas-profile-baremetal"]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    # One slice host and no baremetal-only host: every placement below can only land on HOST, so an
    # unschedulable answer is about HOST alone.
    s = Stack(tmp_path_factory.mktemp("stack"), slice_hosts=1, slots_per_host=4, baremetal_hosts=0)
    s.start()
    yield s
    s.stop()


async def admin(stack: Stack, method: str, path: str, body: Any = None, actor: str = "ops") -> tuple[int, Any]:
    headers = {"Authorization": f"Bearer {stack.scheduler_admin_token}"}
    if method != "GET":
        headers |= {"Idempotency-Key": uuid.uuid4().hex, "X-Actor": actor}
    async with aiohttp.ClientSession() as http:
        async with http.request(method, stack.scheduler_admin_url + path, json=body, headers=headers) as resp:
            return resp.status, await resp.json()


async def ok(stack: Stack, method: str, path: str, body: Any = None) -> Any:
    status, answer = await admin(stack, method, path, body)
    assert status == 200, answer
    return answer


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

    # release: MAAS takes it back; the host returns converting with parity and topology unknown.
    await portal.release(bm)
    await portal.wait_state(bm, "released", timeout=120)

    async def converting() -> dict[str, Any] | None:
        n = await node(stack)
        return n if n["mode"] == "converting" else None

    back = await eventually(converting, timeout=60, what=f"{HOST} converting")
    assert back["mode_changed_by"] == "scheduler" and str(bm) in back["mode_reason"]
    # Nothing learnt before the deployment survives the reset. (The simulated host's agent starts again
    # once MAAS has the machine back and may already have reported anew: only a report made after the
    # reset counts.)
    assert back["evidence_reset_at"] is not None
    reset = datetime.fromisoformat(back["evidence_reset_at"])
    for reported in (back["topology_reported_at"], back["parity_checked_at"]):
        assert reported is None or datetime.fromisoformat(reported) > reset, back
    await assert_no_slice_lands(portal, "converting")

    # The gateway ended the host's slice identity before its baremetal tenant got root on the disk that held it:
    # ops onboard the host again, and its agent connects with the new user.
    stack.onboard_host(HOST)

    # rediscovery: ops ask the host's agent (running again on the re-bootstrapped host) for its topology;
    # ops commands go out as the break-glass admin identity (the `ops` one only reads).
    task_id = f"rediscover-{uuid.uuid4().hex[:8]}"
    nc = await nats.connect(**stack.nats_options("admin"))
    try:
        env = Envelope.wrap(
            "slice.topology_discover",
            {"task_id": task_id, "node_id": HOST, "deadline": (utcnow() + timedelta(minutes=5)).isoformat()},
            producer="ops",
            correlation_id=task_id,
        )
        await nc.jetstream().publish(
            f"gpuaas.node.{HOST}.tasks", env.model_dump_json().encode(), headers={"Nats-Msg-Id": env.event_id}
        )
    finally:
        await nc.drain()
    reported = await portal.spy.wait_type("node.parity_reported", task_id=task_id, timeout=60)
    assert reported["payload"]["failures"] == 0
    await portal.spy.wait_type("node.topology_reported", task_id=task_id, timeout=60)

    async def rediscovered() -> dict[str, Any] | None:
        n = await node(stack)
        return n if n["topology_reported_at"] is not None and n["parity_failures"] == 0 else None

    await eventually(rediscovered, timeout=60, what=f"{HOST} rediscovered and parity-clean")
    # Rediscovered and parity-clean, but not re-approved: still converting, still no slice.
    mode = await ok(stack, "GET", f"/v1/nodes/{HOST}/mode")
    assert mode["mode"] == "converting"
    assert mode["transitions"]["slice"] == ["no slot re-approved since the host's evidence was reset"]
    await assert_no_slice_lands(portal, "converting, rediscovered")

    # re-approval by ops returns it to slice mode.
    candidates = (await ok(stack, "GET", f"/v1/nodes/{HOST}/candidates"))["candidates"]
    assert candidates and all(c["approved_slot_id"] is None for c in candidates)
    complete = [c["candidate_id"] for c in candidates if c["nvme_by_id"] and c["fabric_vf_pci_address"]]
    answer = await ok(
        stack,
        "POST",
        f"/v1/nodes/{HOST}/candidates/approve",
        {"actor": "ops", "reason": "back from baremetal, rediscovered", "candidate_ids": complete},
    )
    assert answer["mode"] == "slice" and {r["status"] for r in answer["results"]} == {"available"}
    # Back in slice mode: the host binds exactly the re-approved slots' devices, and parity checks that set.
    bind = (await portal.spy.wait_type("slice.vfio_apply", task_id=answer["vfio_task"]))["payload"]
    assert bind["action"] == "bind" and len(bind["slots"]) == len(complete)
    after = (await portal.spy.wait_type("node.parity_reported", task_id=answer["vfio_task"], timeout=60))["payload"]
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
        ("converting", "slice", "ops"),
    ]
