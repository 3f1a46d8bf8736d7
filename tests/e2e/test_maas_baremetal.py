"""Baremetal through the MAAS gateway, against the running stack: a failed deployment ends the
allocation with MAAS's own status message and releases the machine, and the gateway's metrics and logs show
what happened; a machine handed other user-data than the gateway sent is refused at its enrolment; a release
erases as the site's wipe policy says and its outcome reaches the ops timeline, and a failed erase keeps the node
out."""

from __future__ import annotations

import uuid

import aiohttp
import pytest

from gpuaas_dev.testing.waiting import eventually

from .conftest import maas_sim

pytestmark = pytest.mark.e2e

CURTIN_FAILURE = "Failed deployment: curtin command install failed (linux-generic DKMS)"


async def test_failed_deployment_fails_the_allocation_with_the_maas_message(portal, stack, db):
    await maas_sim(
        stack,
        "POST",
        "/_sim/faults",
        {"kind": "failed_deployment", "op": "deploy", "count": 1, "status_message": CURTIN_FAILURE},
    )
    alloc = await portal.request("baremetal", gpus=8)
    placed = await portal.wait_state(alloc, "placed")
    system_id = placed["payload"]["maas_system_id"]
    failed = await portal.spy.wait_type("allocation.failed", allocation_id=alloc, timeout=90)
    assert failed["payload"]["reason"] == CURTIN_FAILURE
    assert failed["payload"]["reason_code"] == "maas_failed"
    assert failed["payload"]["cleanup_required"] is True
    assert not portal.spy.of_type("allocation.active", allocation_id=alloc)

    result = portal.spy.of_type("maas.deploy_result", allocation_id=alloc)[0]["payload"]
    assert (result["status"], result["maas_status_name"], result["status_message"]) == (
        "failed",
        "Failed deployment",
        CURTIN_FAILURE,
    )
    op = await db.fetchrow(
        "SELECT state, maas_calls FROM maas_gateway.maas_operations WHERE allocation_id = $1 AND kind = 'deploy'", alloc
    )
    assert dict(op) == {"state": "failed", "maas_calls": 1}

    # The failed machine may hold the tenant's image: it is released through MAAS, the allocation stays failed.
    released = await portal.spy.wait_type("maas.release_result", allocation_id=alloc, timeout=90)
    assert (released["payload"]["status"], released["payload"]["maas_status_name"]) == ("released", "Ready")
    machine = await maas_sim(stack, "GET", f"/_sim/machines/{system_id}")
    assert machine["status_name"] == "Ready"
    assert (machine["_sim"]["calls"]["deploy"], machine["_sim"]["calls"]["release"]) == (1, 1)

    async def kept() -> str | None:
        return await db.fetchval(
            "SELECT reason_code FROM allocator.allocation_timeline WHERE allocation_id = $1 "
            "AND reason_code = 'machine_released_after_failure'",
            alloc,
        )

    await eventually(kept, what="the release kept on the failed allocation's timeline")
    assert await db.fetchval("SELECT state FROM allocator.allocations WHERE allocation_id = $1", alloc) == "failed"

    async def metrics() -> str:
        async with aiohttp.ClientSession() as http:
            async with http.get(stack.health_url("maas-gateway") + "/metrics") as r:
                return await r.text()

    text = await eventually(metrics, what="gateway metrics")
    assert 'gpuaas_maas_operation_seconds_count{kind="deploy",outcome="failed"}' in text
    assert 'gpuaas_maas_breaker_state{site="default"} 0.0' in text
    log = stack.log_path("maas-gateway").read_text()
    assert "operation_finished" in log
    for part in stack.maas_api_key.split(":"):
        assert part not in log


async def test_a_machine_given_other_user_data_than_the_gateway_sent_fails_and_goes_back_to_maas(portal, stack, db):
    # The machine reads user-data whose enrolment token is not the one the gateway wrote: its agent enrols with a
    # proof that is not this allocation's. No later announcement could be better, so the allocation fails at once
    # (not at its enrolment deadline), the machine is released through MAAS and the host's credentials with it.
    await maas_sim(stack, "POST", "/_sim/faults", {"kind": "altered_user_data", "op": "deploy", "count": 1})
    alloc = await portal.request("baremetal", gpus=8)
    placed = await portal.wait_state(alloc, "placed")
    system_id = placed["payload"]["maas_system_id"]
    failed = await portal.spy.wait_type("allocation.failed", allocation_id=alloc, timeout=90)
    assert failed["payload"]["reason_code"] == "enrolment_refused"
    assert "not what the gateway sent" in failed["payload"]["reason"]
    assert not portal.spy.of_type("allocation.active", allocation_id=alloc)
    enrolled = [e for e in portal.spy.of_type("node.enrolled") if e["payload"].get("allocation_id") == str(alloc)]
    assert enrolled and enrolled[0]["payload"]["maas_system_id"] == system_id  # the host did announce itself

    released = await portal.spy.wait_type("maas.release_result", allocation_id=alloc, timeout=90)
    assert (released["payload"]["status"], released["payload"]["maas_status_name"]) == ("released", "Ready")
    machine = await maas_sim(stack, "GET", f"/_sim/machines/{system_id}")
    assert machine["status_name"] == "Ready"

    async def revoked() -> int | None:
        return await db.fetchval(
            "SELECT count(*) FROM maas_gateway.maas_host_credentials WHERE allocation_id = $1 "
            "AND revoked_at IS NOT NULL",
            str(alloc),
        )

    assert await eventually(revoked, what="the host's credentials revoked with the release") >= 1


# --- the release's erase follows the site's wipe policy, and its outcome reaches the ops timeline -------------------


async def _scheduler(stack, method: str, path: str, body=None):
    headers = {"Authorization": f"Bearer {stack.scheduler_admin_token}"}
    if method != "GET":
        headers |= {"Idempotency-Key": uuid.uuid4().hex, "X-Actor": "ops"}
    async with aiohttp.ClientSession() as http:
        async with http.request(method, stack.scheduler_admin_url + path, json=body, headers=headers) as resp:
            answer = await resp.json()
            assert resp.status == 200, answer
            return answer


async def _site_policy(stack, policy: str) -> None:
    body = {"destructive_wipe_policy": policy, "actor": "ops", "reason": "erase e2e"}
    await _scheduler(stack, "PUT", "/v1/sites/default/wipe-policy", body)


async def _ops_timeline_erase(stack, alloc: uuid.UUID, state: str) -> dict:
    """The allocation's `state` entry on ops-view's timeline (its admin API), once it carries the machine's erase."""
    headers = {"Authorization": f"Bearer {stack.admin_token('ops-view')}"}

    async def found() -> dict | None:
        async with aiohttp.ClientSession() as http:
            async with http.get(f"{stack.admin_url('ops-view')}/v1/allocations/{alloc}", headers=headers) as resp:
                if resp.status != 200:
                    return None
                body = await resp.json()
        entries = [t for t in body["timeline"] if t["state"] == state and (t.get("detail") or {}).get("machine_erase")]
        return entries[0]["detail"]["machine_erase"] if entries else None

    return await eventually(found, timeout=30, what=f"{alloc}'s {state} with its erase on the ops timeline")


async def _active_baremetal(portal) -> tuple[uuid.UUID, dict]:
    """An active baremetal allocation and the scheduler's placement of it."""
    alloc = await portal.request("baremetal", gpus=8)
    await portal.wait_state(alloc, "placed")
    placement = await portal.spy.wait_type("placement.placed", allocation_id=alloc)
    await portal.wait_state(alloc, "active", timeout=90)
    return alloc, placement["payload"]


@pytest.mark.parametrize(
    "policy, mode",
    [("crypto_erase", "secure"), ("nvme_format", "secure"), ("blkdiscard", "full")],
)
async def test_a_baremetal_release_erases_as_the_site_policy_says_and_the_outcome_reaches_the_ops_timeline(
    portal, stack, db, policy, mode
):
    await _site_policy(stack, policy)
    alloc, placed = await _active_baremetal(portal)
    assert placed["wipe_policy"] == policy
    await portal.release(alloc)
    released = await portal.wait_state(alloc, "released", timeout=90)

    # What MAAS was asked, from the simulator's own record of the call (over its API): never a quick erase.
    machine = await maas_sim(stack, "GET", f"/_sim/machines/{placed['maas_system_id']}")
    asked = machine["_sim"]["last_release"]
    assert (asked["erase"], asked["secure_erase"], asked["quick_erase"], asked["erase_mode"]) == (
        True,
        mode == "secure",
        False,
        mode,
    )
    result = portal.spy.of_type("maas.release_result", allocation_id=alloc)[0]["payload"]
    assert (result["status"], result["erase_mode"], result["erase_outcome"]) == ("released", mode, "erased")
    erase = released["payload"]["machine_erase"]
    assert (erase["mode"], erase["outcome"], erase["maas_status_name"]) == (mode, "erased", "Ready")
    assert await _ops_timeline_erase(stack, alloc, "released") == erase
    await _site_policy(stack, "blkdiscard")


async def test_a_failed_erase_fails_the_release_with_its_reason_and_the_node_is_not_placed_again(portal, stack, db):
    await _site_policy(stack, "nvme_format")
    alloc, placed = await _active_baremetal(portal)
    node, system_id = placed["node_id"], placed["maas_system_id"]
    await maas_sim(
        stack,
        "POST",
        "/_sim/faults",
        {"kind": "failed_disk_erasing", "op": "release", "system_id": system_id, "count": 1},
    )
    await portal.release(alloc)
    failed = await portal.spy.wait_type("allocation.failed", allocation_id=alloc, timeout=90)
    assert (failed["payload"]["reason_code"], failed["payload"]["cleanup_required"]) == ("disk_erase_failed", True)
    assert (failed["payload"]["machine_erase"]["mode"], failed["payload"]["machine_erase"]["outcome"]) == (
        "secure",
        "failed",
    )
    assert not portal.spy.of_type("allocation.released", allocation_id=alloc)
    machine = await maas_sim(stack, "GET", f"/_sim/machines/{system_id}")
    assert machine["status_name"] == "Failed disk erasing"
    assert (await _ops_timeline_erase(stack, alloc, "failed"))["outcome"] == "failed"

    # The scheduler drains the node (a node held whole, cleanup required): the next baremetal request lands elsewhere
    # or nowhere, never on the machine whose disks may still hold the tenant's data.
    async def drained() -> bool:
        return bool(await db.fetchval("SELECT draining FROM scheduler.nodes WHERE node_id = $1", node))

    await eventually(drained, what=f"{node} drained after its failed erase")
    nxt = await portal.request("baremetal", gpus=8)
    outcome = await portal.spy.wait_for(
        lambda: (
            (portal.spy.of_type("allocation.placed", allocation_id=nxt) or [None])[0]
            or (portal.spy.of_type("allocation.unschedulable", allocation_id=nxt) or [None])[0]
        ),
        60,
        f"{nxt} placed or unschedulable",
    )
    assert outcome["payload"].get("node_id") != node
    if outcome["type"] == "allocation.placed":
        await portal.wait_state(nxt, "active", timeout=90)
        await portal.release(nxt)
        await portal.wait_state(nxt, "released", timeout=90)
    await _site_policy(stack, "blkdiscard")
