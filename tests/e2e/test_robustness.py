"""Idempotency, poison input, crashes and unknown MAAS outcomes, against the running stack."""

from __future__ import annotations

import json
import signal
import uuid

import pytest

from gpuaas_common.contract import Envelope

from .conftest import maas_sim

pytestmark = pytest.mark.e2e


async def _allocation_rows(db, alloc: uuid.UUID) -> int:
    return await db.fetchval("SELECT count(*) FROM allocator.allocations WHERE allocation_id = $1", alloc)


async def test_the_same_request_twice_yields_one_allocation(portal, db):
    alloc = uuid.uuid4()
    body = {
        "allocation_id": str(alloc),
        "tenant_id": "tenant-a",
        "shape": "gpu_slice",
        "sku": "h200-sxm-slice",
        "gpu_count": 1,
        "image": "ubuntu-24.04-h200-slice",
        "ssh_public_keys": ["ssh-ed25519 AAAAC3Nza tenant@x"],
    }
    # Distinct Nats-Msg-Ids get past JetStream dedup: only the allocator's idempotency key can stop it.
    await portal.publish("allocation.requested", body, msg_id=str(uuid.uuid4()))
    await portal.publish("allocation.requested", body, msg_id=str(uuid.uuid4()))
    await portal.wait_state(alloc, "active")
    conflicting = {**body, "gpu_count": 2}
    await portal.publish("allocation.requested", conflicting)
    rejected = await portal.spy.wait_type("allocation.rejected", allocation_id=alloc)
    assert rejected["payload"]["reason_code"] == "idempotency_conflict"
    assert await _allocation_rows(db, alloc) == 1
    assert len(portal.spy.of_type("allocation.accepted", allocation_id=alloc)) == 1
    assert len(portal.spy.of_type("placement.placed", allocation_id=alloc)) == 1
    await portal.release(alloc)
    await portal.wait_state(alloc, "released")


async def test_redelivered_relayed_events_cause_no_second_effect(portal, db):
    alloc = await portal.request("gpu_slice", gpus=1)
    await portal.wait_state(alloc, "active")
    # Replay every event of this allocation so far, as a relay retrying after an outage would.
    replayed = [
        (subj, data)
        for subj, data in list(portal.spy.messages)
        if data.get("payload", {}).get("allocation_id") == str(alloc)
    ]
    assert len(replayed) >= 8
    for subject, data in replayed:
        await portal.js.publish(subject, json.dumps(data).encode(), headers={"Nats-Msg-Id": str(uuid.uuid4())})
    await portal.release(alloc)
    await portal.wait_state(alloc, "released")
    claims = await db.fetchval(
        "SELECT count(*) FROM scheduler.allocation_resource_claims WHERE allocation_id = $1", alloc
    )
    assert claims == 1
    timeline = await db.fetch(
        "SELECT state, previous_state, reason_code, detail FROM allocator.allocation_timeline WHERE allocation_id = $1",
        alloc,
    )
    moves = [r for r in timeline if r["previous_state"] != r["state"]]
    assert len(moves) == 7
    notes = [(r["reason_code"], str(r["detail"])) for r in timeline if r["previous_state"] == r["state"]]
    assert len(notes) == len(set(notes)), "a replayed result wrote its notes (phases, stop path) again"
    results = {d["event_id"] for d in portal.spy.of_type("node.task_result", allocation_id=alloc)}
    assert len(results) == 2  # one provision result and one release result, however often replayed


async def test_malformed_input_is_rejected_or_dead_lettered_and_writes_nothing(portal, db):
    await portal.publish_raw(b"this is not json")
    missing = Envelope.wrap("allocation.requested", {"tenant_id": "t"}, producer="portal", correlation_id="x")
    await portal.publish_raw(missing.model_dump_json().encode())
    bad = {}
    for label, overrides in {
        "three_gpus": {"gpu_count": 3},
        "unknown_sku": {"sku": "h100-pcie"},
        "unknown_image": {"image": "no-such-image"},
    }.items():
        bad[label] = await portal.request("gpu_slice", gpus=overrides.pop("gpu_count", 1), **overrides)
    codes = {}
    for label, alloc in bad.items():
        codes[label] = (await portal.spy.wait_type("allocation.rejected", allocation_id=alloc))["payload"][
            "reason_code"
        ]
    assert codes == {
        "three_gpus": "invalid_gpu_count",
        "unknown_sku": "unknown_sku",
        "unknown_image": "image_not_active",
    }
    letters = await portal.spy.wait_for(
        lambda: (
            [d for s, d in portal.spy.messages if s == "gpuaas.dlq.allocator-requested"][:2] or None
            if len([1 for s, _ in portal.spy.messages if s == "gpuaas.dlq.allocator-requested"]) >= 2
            else None
        ),
        what="two dead letters",
    )
    assert sorted(d["payload"]["reason_code"] for d in letters) == ["not_json", "schema_invalid"]
    for alloc in bad.values():
        assert await _allocation_rows(db, alloc) == 0
    # The consumer is still alive: a good request right after goes through.
    good = await portal.request("gpu_slice", gpus=1)
    await portal.wait_state(good, "active")
    await portal.release(good)
    await portal.wait_state(good, "released")


async def test_kill_9_mid_flow_then_restart_loses_nothing(portal, stack, db):
    # Stop the node agents so the allocation parks in provisioning, then kill the allocator (and
    # with it its outbox relay) and the scheduler with SIGKILL while work is in flight.
    stack.kill("node-agent", signal.SIGKILL)
    alloc = await portal.request("gpu_slice", gpus=4)
    await portal.wait_state(alloc, "provisioning")
    stack.kill("allocator", signal.SIGKILL)
    stack.kill("scheduler", signal.SIGKILL)
    second = await portal.request("gpu_slice", gpus=1)
    stack.restart("scheduler")
    stack.restart("allocator")
    stack.restart("node-agent")
    await portal.wait_state(alloc, "active", timeout=90)
    await portal.wait_state(second, "active", timeout=90)
    for a in (alloc, second):
        await portal.release(a)
        await portal.wait_state(a, "released", timeout=60)
        states = [
            r["state"]
            for r in await db.fetch(
                "SELECT state FROM allocator.allocation_timeline WHERE allocation_id = $1 "
                "AND previous_state IS DISTINCT FROM state ORDER BY seq",  # the moves, not the notes
                a,
            )
        ]
        assert states == ["requested", "accepted", "placed", "provisioning", "active", "releasing", "released"]


async def test_deploy_response_lost_after_commit_is_polled_not_resubmitted(portal, stack, db):
    await maas_sim(
        stack, "POST", "/_sim/faults", {"kind": "lost_after_commit", "op": "deploy", "count": 1, "mode": "close"}
    )
    alloc = await portal.request("baremetal", gpus=8)
    placed = await portal.wait_state(alloc, "placed")
    system_id = placed["payload"]["maas_system_id"]
    await portal.wait_state(alloc, "active", timeout=90)
    result = portal.spy.of_type("maas.deploy_result", allocation_id=alloc)[0]["payload"]
    assert result["status"] == "deployed" and result["resolution"] == "polled" and result["attempts"] == 1
    calls = await maas_sim(stack, "GET", "/_sim/calls")
    assert calls["calls"]["deploy"][system_id] == 1
    op = await db.fetchrow(
        "SELECT state, maas_calls, resolution FROM maas_gateway.maas_operations "
        "WHERE allocation_id = $1 AND kind = 'deploy'",
        alloc,
    )
    assert dict(op) == {"state": "succeeded", "maas_calls": 1, "resolution": "polled"}
    await portal.release(alloc)
    await portal.wait_state(alloc, "released", timeout=90)
