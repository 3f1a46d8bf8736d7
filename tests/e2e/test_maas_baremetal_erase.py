"""A baremetal release through the stack (real nats, Postgres, the services and the MAAS simulator): MAAS is asked
the erase of the site's wipe policy (read back from the simulator's own record, over its API), the outcome reaches
the ops timeline, and a failed erase fails the release with its reason and keeps the node out. Its own stack: the
failures of test_maas_baremetal.py drain that module's machines."""

from __future__ import annotations

import uuid

import aiohttp
import pytest

from gpuaas_dev.testing.waiting import eventually

from .conftest import maas_sim, scheduler_ok

pytestmark = pytest.mark.e2e


async def _site_policy(stack, policy: str) -> None:
    body = {"destructive_wipe_policy": policy, "actor": "ops", "reason": "erase e2e"}
    await scheduler_ok(stack, "PUT", "/v1/sites/default/wipe-policy", body)


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
    [("crypto_erase", "secure"), ("nvme_format", "secure"), ("blkdiscard", "secure")],
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
