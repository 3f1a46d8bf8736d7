"""A converting host whose redeployed OS fails parity: the scheduler's walk back to slice mode stops at that
failure with the failing check named on the node (its walk, as `gpuaas nodes show` prints it), re-approves
nothing and asks nothing again; the host stays converting, out of every placement. Through the service
processes, the MAAS simulator and the simulated host's own agent, whose host tree lacks /dev/kvm after the
redeploy as a host whose firmware lost VT-x would."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpuaas_dev.cli.inventory import _node_detail_text
from gpuaas_dev.stack import Stack
from gpuaas_dev.testing.waiting import eventually
from gpuaas_node_agent.service_layer.host_paths import HostPaths

from .conftest import scheduler_ok as ok

pytestmark = pytest.mark.e2e

HOST = "slice-01"
TAGS = ["gpuaas-profile-slice-vm", "gpuaas-profile-baremetal"]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = Stack(tmp_path_factory.mktemp("stack"), slice_hosts=1, slots_per_host=2, baremetal_hosts=0)
    s.start()
    yield s
    s.stop()


async def test_a_parity_failure_after_the_redeploy_stops_the_walk_with_the_failing_check(stack, portal, db):
    current = (await ok(stack, "GET", f"/v1/nodes/{HOST}"))["node"]
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
    await ok(stack, "POST", f"/v1/nodes/{HOST}/mode", {"actor": "ops", "mode": "drained", "reason": "re-image"})
    await ok(stack, "POST", f"/v1/nodes/{HOST}/slots/retire", {"actor": "ops", "reason": "host is re-imaged"})
    had = sorted(
        r["slot_id"]
        for r in await db.fetch("SELECT slot_id FROM scheduler.node_resource_slots WHERE node_id = $1", HOST)
    )
    # The host the redeploy brings back has no KVM.
    node = next(n for n in stack.fleet.nodes if n.node_id == HOST)
    HostPaths(Path(node.host_root)).host("/dev/kvm").unlink()
    await ok(stack, "POST", f"/v1/nodes/{HOST}/mode", {"actor": "ops", "mode": "converting", "reason": "re-image"})

    async def ended() -> dict[str, Any] | None:
        doc = await ok(stack, "GET", f"/v1/nodes/{HOST}")
        return doc if doc["walks"] and doc["walks"][0]["state"] in ("reapproved", "stopped") else None

    doc = await eventually(ended, timeout=240, what=f"{HOST}'s walk to end")
    walk = doc["walks"][0]
    assert walk["state"] == "stopped", walk
    assert walk["reason"].startswith("parity failed: parity reported 1 failure(s): kvm"), walk
    # Topology and parity come on two durables: the failure stops the walk whichever came first.
    assert [st["to_state"] for st in walk["steps"]] in (
        ["redeploy_requested", "deployed", "stopped"],
        ["redeploy_requested", "deployed", "rediscovered", "stopped"],
    ), walk
    assert sorted(walk["slots"]) == had
    # Nothing re-approved; the host stays converting and takes no slice.
    assert doc["node"]["mode"] == "converting" and doc["node"]["parity_failures"] == 1
    statuses = await db.fetch("SELECT status FROM scheduler.node_resource_slots WHERE node_id = $1", HOST)
    assert {r["status"] for r in statuses} == {"retired"}
    alloc = await portal.request("gpu_slice", gpus=1)
    u = (await portal.spy.wait_type("allocation.unschedulable", allocation_id=alloc, timeout=60))["payload"]
    assert u["filtered"] == {"host_mode": 1}, u
    # The node says why, as `gpuaas nodes show` prints it.
    text = _node_detail_text(doc, "table", False)
    assert "walks back to slice mode" in text and "stopped: parity failed: parity reported 1 failure(s): kvm" in text
    # No retry behind anyone's back: one walk, one rediscovery asked, nothing more after the stop.
    walks = await db.fetchval("SELECT count(*) FROM scheduler.host_walks WHERE node_id = $1", HOST)
    rediscoveries = await db.fetchval(
        "SELECT count(*) FROM scheduler.node_actions WHERE node_id = $1 AND kind = 'rediscover'", HOST
    )
    assert (walks, rediscoveries) == (1, 1)
