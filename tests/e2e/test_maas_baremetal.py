"""Baremetal through the MAAS gateway, against the running stack: a failed deployment ends the
allocation with MAAS's own status message and releases the machine, and the gateway's metrics and logs show
what happened; a machine handed other user-data than the gateway sent is refused at its enrolment."""

from __future__ import annotations

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
