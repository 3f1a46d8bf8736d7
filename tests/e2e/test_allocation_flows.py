"""Both allocation shapes end to end through five separate service processes; then what ops page on, read from
the same stack by a real Prometheus."""

from __future__ import annotations

import json
import shutil
import uuid

import aiohttp
import pytest

from gpuaas_dev import metrics_catalog
from gpuaas_dev.testing import prometheus
from gpuaas_dev.testing.waiting import eventually

from .conftest import maas_sim

pytestmark = pytest.mark.e2e

FULL_LIFECYCLE = ["requested", "accepted", "placed", "provisioning", "active", "releasing", "released"]


async def _timeline(db, alloc: uuid.UUID) -> list[str]:
    """The states it moved through (notes, such as provisioning phases, stay in their state)."""
    rows = await db.fetch(
        "SELECT state FROM allocator.allocation_timeline WHERE allocation_id = $1 "
        "AND previous_state IS DISTINCT FROM state ORDER BY seq",
        alloc,
    )
    return [r["state"] for r in rows]


async def _notes(db, alloc: uuid.UUID, reason_code: str) -> list[dict]:
    rows = await db.fetch(
        "SELECT detail FROM allocator.allocation_timeline WHERE allocation_id = $1 AND reason_code = $2 ORDER BY seq",
        alloc,
        reason_code,
    )
    return [json.loads(r["detail"]) if isinstance(r["detail"], str) else r["detail"] for r in rows]


async def _live_claims(db, alloc: uuid.UUID) -> int:
    return await db.fetchval(
        "SELECT count(*) FROM scheduler.allocation_resource_claims WHERE allocation_id = $1 AND status <> 'released'",
        alloc,
    )


async def test_slice_allocation_goes_active_and_is_released_with_wipe_proof(portal, db):
    alloc = await portal.request("gpu_slice", gpus=2)
    placed = await portal.wait_state(alloc, "placed")
    slots = placed["payload"]["slots"]
    assert len(slots) == 2 and placed["payload"]["claim_mode"] == "slots"
    active = await portal.wait_state(alloc, "active")
    access = active["payload"]["access"]
    assert access["ssh_ready"] is True and access["ip"] == slots[0]["private_ip"]
    task = portal.spy.of_type("slice.vm_provision", allocation_id=alloc)[0]["payload"]
    assert task["image"]["slug"] == "ubuntu-24.04-h200-slice" and len(task["image"]["digest_sha256"]) == 64
    # The catalog's driver strategy, as the allocator learnt it from image.activated, reaches the host...
    announced = await db.fetchval(
        "SELECT driver_strategy FROM allocator.active_images WHERE slug = $1", task["image"]["slug"]
    )
    assert task["image"]["driver_strategy"] == announced == "preinstalled"
    # The two GPUs are one NVLink partition of the simulated board, a pair (issue 29): the module IDs discovery
    # read from the host's nvidia-smi went through approval and placement to the task that activates it.
    pairs = {3: {1, 3}, 4: {2, 4}, 5: {5, 7}, 6: {6, 8}}
    assert {s["module_id"] for s in task["slots"]} == pairs[task["nvlink_partition"]]
    # ...whose simulated guest reported both GPUs its domain was given, with a working driver.
    (result,) = [
        e["payload"]
        for e in portal.spy.of_type("node.task_result", allocation_id=alloc)
        if e["payload"]["task_type"] == "slice.vm_provision"
    ]
    assert result["readiness"]["guest_gpus"] == {
        "expected": 2,
        "pci": 2,
        "driver": 2,
        "driver_state": "loaded",
        "driver_version": "580.159.04",
        "driver_strategy": "preinstalled",
    }

    async def slot_statuses() -> set[str]:
        rows = await db.fetch(
            "SELECT status FROM scheduler.node_resource_slots WHERE slot_id = ANY($1::text[])",
            [s["slot_id"] for s in slots],
        )
        return {r["status"] for r in rows}

    # The scheduler follows the lifecycle asynchronously; its slots reach 'active' shortly after.
    await eventually(lambda: _equals(slot_statuses(), {"active"}), timeout=30, what="slots active")

    await portal.release(alloc)
    released = await portal.wait_state(alloc, "released")
    # The release deactivates that partition once the VM is shut down.
    (release_task,) = [e["payload"] for e in portal.spy.of_type("slice.vm_release", allocation_id=alloc)]
    assert release_task["nvlink_partition"] == task["nvlink_partition"]
    cleanup = released["payload"]["cleanup"]
    assert cleanup["required"] and cleanup["verified"]
    assert sorted(p["device"] for p in cleanup["wipe_proofs"]) == sorted(s["nvme_by_id"] for s in slots)
    assert await _timeline(db, alloc) == FULL_LIFECYCLE
    # Where the time went, on the timeline for ops: each provisioning phase with its seconds, and how the VM
    # stopped at release.
    phases = {n["phase"]: n["seconds"] for n in await _notes(db, alloc, "provision_phase")}
    assert {"seed", "clone_image", "dhcp_reservation", "define", "wait_ready"} <= set(phases)
    assert all(seconds >= 0 for seconds in phases.values())
    (stopped,) = await _notes(db, alloc, "vm_stopped")
    assert stopped["stop_path"] in ("graceful", "already_off")

    async def freed() -> bool:
        return await slot_statuses() == {"available"} and await _live_claims(db, alloc) == 0

    await eventually(freed, timeout=30, what="slots available and claims released")


async def test_baremetal_allocation_goes_active_through_maas_and_is_released(portal, db, stack):
    alloc = await portal.request("baremetal", gpus=8)
    placed = await portal.wait_state(alloc, "placed")
    assert placed["payload"]["claim_mode"] == "node_exclusive"
    system_id = placed["payload"]["maas_system_id"]
    await portal.wait_state(alloc, "active", timeout=90)
    machine = await maas_sim(stack, "GET", f"/_sim/machines/{system_id}")
    assert machine["status_name"] == "Deployed"
    await portal.release(alloc)
    released = await portal.wait_state(alloc, "released", timeout=90)
    assert released["payload"]["cleanup"]["required"] is True
    assert await _timeline(db, alloc) == FULL_LIFECYCLE
    machine = await maas_sim(stack, "GET", f"/_sim/machines/{system_id}")
    assert machine["status_name"] == "Ready"
    await eventually(lambda: _no_claims(db, alloc), timeout=30, what="node claim released")


async def _no_claims(db, alloc) -> bool:
    return await _live_claims(db, alloc) == 0


async def _equals(awaitable, expected) -> bool:
    return await awaitable == expected


# --- what ops page on, against this module's stack after the allocations above ---------------------------------

PROCESSES = ("allocator", "scheduler", "image-pipeline", "maas-gateway", "ops-view", "node-agent")


async def test_alert_rules_and_dashboard_evaluate_against_the_stacks_real_metrics(stack, portal, tmp_path):
    """A real Prometheus scrapes every process of the stack each second with deploy/prometheus/alerts.yml loaded:
    a message that breaks the contract (dead-lettered by the allocator) fires GpuaasDeadLettersGrowing; then each
    rule's expression and each dashboard panel's evaluates, every series a rule names is in the processes' own
    /metrics, and every gpuaas_* family they serve is in the README's metrics table."""
    if shutil.which("prometheus") is None:
        pytest.fail("prometheus is not installed; run `make setup` (Debian's prometheus package)")
    names = {job: stack.replica_names(job) for job in PROCESSES}
    targets = {job: [stack.health_url(n).removeprefix("http://") for n in replicas] for job, replicas in names.items()}
    prom = prometheus.Prometheus(tmp_path / "prometheus", targets).start()
    try:
        await prom.wait_until_scraped()
        # The dead-letter count as scraped before the poison message, so the rule sees it grow.
        before = await eventually(
            lambda: prom.query("gpuaas_dlq_dead_letters_total"), timeout=10, what="the DLQ count scraped"
        )
        body = b"not json: a portal bug"
        await portal.publish_raw(body)
        (alert,) = await eventually(
            lambda: prom.firing("GpuaasDeadLettersGrowing"), timeout=20, what="GpuaasDeadLettersGrowing firing"
        )
        assert alert["annotations"]["summary"].endswith("new dead letters in the last 10 minutes")
        after = await prom.query("gpuaas_dlq_dead_letters_total")
        assert float(after[0]["value"][1]) > float(before[0]["value"][1])

        scraped: set[str] = set()
        async with aiohttp.ClientSession() as http:
            for job, replicas in names.items():
                for name in replicas:
                    async with http.get(f"{stack.health_url(name)}/metrics") as resp:
                        assert resp.status == 200, name
                        page = await resp.text()
                    scraped |= prometheus.scraped_names(page)
                    (build,) = [line for line in page.splitlines() if line.startswith("gpuaas_build_info{")]
                    assert f'service="{job}"' in build and 'git_sha="' in build, build
        failing = await prom.query("gpuaas_metrics_reading_up == 0")
        assert failing == [], f"readings that failed: {[f['metric'] for f in failing]}"
        served = {n for n in scraped if n.startswith("gpuaas_")}
        assert served - metrics_catalog.series_names() == set(), "served but not in the README's metrics table"

        for rule in prometheus.rules():
            await prom.query(rule["expr"])  # raises on anything but success
            missing = prometheus.names_in(rule["expr"]) - scraped - {"up"}
            assert missing == set(), f"{rule['alert']} reads series no process serves: {missing}"
        dashboard = json.loads(prometheus.DASHBOARD.read_text())
        for panel in dashboard["panels"]:
            for target in panel.get("targets", []):
                await prom.query(target["expr"].replace("$__rate_interval", "1m"))
                unknown = prometheus.names_in(target["expr"]) - metrics_catalog.series_names()
                assert unknown == set(), f"panel {panel['title']!r} reads series the code never serves: {unknown}"
    finally:
        prom.stop()
