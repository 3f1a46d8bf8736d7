"""A baremetal tenant's data never reaches a slice tenant (issue 38), on the fixture fleet: the tenant of a
converted host writes a random marker at the start, the middle and the end of every slot disk of the host (on the
disk's own backing file, the one the host's agent wipes and hands to VMs), releases; the host walks back to slice
mode; every slot is freed only by its host's wipe proof; then a slice allocation on each slot, and the disk its VM
was given holds no marker anywhere. The marker is read by the same path right after the release, before any wipe
was asked, and is there: a skipped wipe would have shown. (A slice's image is cloned over the first MiBs of its
disk, which would bury the start marker anyway; the middle and end ones go only with the wipe.) "No slot placeable
before its proof": no slice lands while the host converts, and each slot's history since it was retired is exactly
retired -> awaiting_wipe -> available, the last step its host's proof (the awaiting window itself, held open, is
tests/integration/test_scheduler_slot_wipe.py's).

The host walk itself (every step, its MAAS deploys, its VFIO binding) is test_host_mode_walk.py's; here the walk is
driven only as far as the disks need."""

from __future__ import annotations

import json
import os
import secrets
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from gpuaas_dev.stack import Stack
from gpuaas_dev.testing.waiting import eventually

from .conftest import maas_sim
from .test_host_mode_walk import HOLD_DEPLOY, TAGS, assert_no_slice_lands, node, ok

pytestmark = pytest.mark.e2e

HOST = "slice-01"
SLOTS = 4
BLOCK = 4096


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    # One slice host and no baremetal-only host: the baremetal tenant and every slice below land on HOST.
    s = Stack(tmp_path_factory.mktemp("stack"), slice_hosts=1, slots_per_host=SLOTS, baremetal_hosts=0)
    s.start()
    yield s
    s.stop()


def backing_file(stack: Stack, by_id: str) -> Path:
    """The file that is the slot's disk on the simulated host: what its by-id link resolves to in the host's tree
    (the agent wipes it and hands it to VMs; a tenant who is root on the machine writes it)."""
    [host] = [n for n in stack.fleet.nodes if n.node_id == HOST]
    assert host.host_root, "the fixture host has no tree of its own"
    root = Path(host.host_root).resolve()
    real = (root / by_id.lstrip("/")).resolve()
    assert real.parent == root / "dev" and real.is_file(), f"{by_id} resolves to {real}, not a disk of {root}"
    return real


def marker_offsets(size: int) -> list[int]:
    return [0, (size // 2) // BLOCK * BLOCK, size - BLOCK]


def write_marker(path: Path, marker: bytes) -> list[int]:
    """What the baremetal tenant does as root: the marker at the disk's start, middle and end, synced."""
    offsets = marker_offsets(path.stat().st_size)
    with path.open("r+b") as disk:
        for off in offsets:
            disk.seek(off)
            disk.write(marker)
        disk.flush()
        os.fsync(disk.fileno())
    return offsets


def marker_found_at(path: Path, marker: bytes) -> list[int]:
    """Every offset of the whole disk where the marker is, read through the page cache as a guest's reads are."""
    data = path.read_bytes()
    found, at = [], data.find(marker)
    while at != -1:
        found.append(at)
        at = data.find(marker, at + 1)
    return found


def disks_given(domains: list[dict[str, Any]]) -> dict[Path, str]:
    """The disks the host's VMs were given, as the files they are, each with its domain's name."""
    return {Path(d).resolve(): dom["name"] for dom in domains for d in dom["disks"]}


async def sim_hosts(stack: Stack) -> dict[str, Any]:
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{stack.fleet_sim_url}/sim/hosts") as resp:
            assert resp.status == 200
            return await resp.json()


async def ops_host(stack: Stack) -> dict[str, Any]:
    """The host as the ops API (ops-view's read models) shows it."""
    headers = {"Authorization": f"Bearer {stack.admin_token('ops-view')}"}
    async with aiohttp.ClientSession(headers=headers) as http:
        async with http.get(f"{stack.admin_url('ops-view')}/v1/hosts/{HOST}") as resp:
            assert resp.status == 200, await resp.text()
            return await resp.json()


async def converted_and_held_by_a_baremetal_tenant(stack: Stack, portal) -> tuple[uuid.UUID, str]:
    """Ops make HOST convertible, drain it, retire its slots and give it to a baremetal tenant: the allocation is
    active on it. Returns the allocation and HOST's MAAS system id."""
    current = await node(stack)
    body = {k: current[k] for k in ("hostname", "sku", "maas_system_id")}
    await ok(
        stack, "POST", "/v1/nodes", {"actor": "ops", "node_id": HOST, "kind": "slice_host", "maas_tags": TAGS, **body}
    )
    await ok(stack, "POST", f"/v1/nodes/{HOST}/mode", {"actor": "ops", "mode": "drained", "reason": "tenant wants it"})
    await ok(stack, "POST", f"/v1/nodes/{HOST}/slots/retire", {"actor": "ops", "reason": "host goes baremetal"})
    await ok(stack, "POST", f"/v1/nodes/{HOST}/mode", {"actor": "ops", "mode": "baremetal", "reason": "tenant"})
    bm = await portal.request("baremetal", gpus=8)
    placed = await portal.wait_state(bm, "placed")
    assert placed["payload"]["node_id"] == HOST
    await portal.wait_state(bm, "active", timeout=120)
    return bm, placed["payload"]["maas_system_id"]


async def test_a_baremetal_tenants_marker_on_every_slot_disk_is_read_by_no_slice_tenant(stack, portal, db):
    slots = {
        r["slot_id"]: r["nvme_by_id"]
        for r in await db.fetch(
            "SELECT slot_id, nvme_by_id FROM scheduler.node_resource_slots WHERE node_id = $1", HOST
        )
    }
    assert len(slots) == SLOTS
    disks = {slot_id: backing_file(stack, by_id) for slot_id, by_id in slots.items()}
    assert len(set(disks.values())) == SLOTS  # every slot its own disk

    bm, system_id = await converted_and_held_by_a_baremetal_tenant(stack, portal)
    # The tenant, root on the machine, writes its own marker on every slot disk.
    markers = {slot_id: b"gpuaas-marker:" + secrets.token_hex(24).encode() for slot_id in slots}
    written = {slot_id: write_marker(disks[slot_id], markers[slot_id]) for slot_id in slots}

    # Release, with the walk's slice-host deploy held by MAAS: the host is converting, nothing wiped it yet.
    binds_before = len(portal.spy.of_type("slice.vfio_apply", node_id=HOST, action="bind"))
    held = (await maas_sim(stack, "POST", "/_sim/faults", HOLD_DEPLOY | {"system_id": system_id}))["faults"][0]
    await portal.release(bm)
    await portal.wait_state(bm, "released", timeout=120)

    async def deploy_refused() -> dict[str, Any] | None:
        faults = (await maas_sim(stack, "GET", "/_sim/faults"))["faults"]
        return next((f for f in faults if f["id"] == held["id"] and f["fired"] > 0), None)

    await eventually(deploy_refused, timeout=90, what="the walk's slice-host deploy reaching MAAS")
    assert (await node(stack))["mode"] == "converting"
    # Right before the wipe, the marker is on every disk where the tenant put it, read the way the slice tenant's
    # disk is read below: were the wipe skipped, that read would find it.
    for slot_id, disk in disks.items():
        assert marker_found_at(disk, markers[slot_id]) == written[slot_id], slot_id
    assert not portal.spy.of_type("slice.slot_wipe", node_id=HOST), "a wipe was asked before the host came back"
    retired = await db.fetch(
        "SELECT status FROM scheduler.node_resource_slots WHERE slot_id = ANY($1::text[])", list(slots)
    )
    assert {r["status"] for r in retired} == {"retired"}
    await assert_no_slice_lands(portal, "converting, its disks not wiped")
    await maas_sim(stack, "DELETE", f"/_sim/faults?id={held['id']}")

    # The walk re-approves the slots awaiting the host's wipe proof; each is freed by that proof alone.
    async def all_available() -> list[Any] | None:
        rows = await db.fetch(
            "SELECT slot_id FROM scheduler.node_resource_slots WHERE node_id = $1 AND status = 'available'", HOST
        )
        return rows if len(rows) == SLOTS else None

    await eventually(all_available, timeout=300, what=f"{HOST}'s walk back and its slots' wipe proofs")
    freed_by: dict[str, dict[str, Any]] = {}
    for slot_id, by_id in slots.items():
        moves = await db.fetch(
            "SELECT from_status, to_status, actor, detail, at FROM scheduler.slot_transitions WHERE slot_id = $1 "
            "ORDER BY id",
            slot_id,
        )
        pairs = [(r["from_status"], r["to_status"]) for r in moves]
        # Placeable only from its proof on: retired -> awaiting_wipe -> available, and nothing in between.
        since_retired = pairs[[p[1] for p in pairs].index("retired") + 1 :]
        assert since_retired == [("retired", "awaiting_wipe"), ("awaiting_wipe", "available")], pairs
        freed = moves[-1]
        detail = json.loads(freed["detail"]) if isinstance(freed["detail"], str) else freed["detail"]
        assert freed["actor"] == f"node:{HOST}" and detail["proof"]["verified"] is True, detail
        freed_by[slot_id] = detail
        # The proof is the host's answer to the wipe the scheduler asked of it for this disk.
        task = await portal.spy.wait_type("slice.slot_wipe", task_id=detail["wipe_task"], timeout=5)
        assert {"slot_id": slot_id, "nvme_by_id": by_id} in [
            {k: s[k] for k in ("slot_id", "nvme_by_id")} for s in task["payload"]["slots"]
        ]
        report = await portal.spy.wait_type("node.slot_wipe_reported", task_id=detail["wipe_task"], timeout=5)
        [outcome] = [o for o in report["payload"]["outcomes"] if o["slot_id"] == slot_id]
        assert outcome["proof"]["device"] == by_id and outcome["proof"]["verified"] is True, outcome
        # The slot's record (the scheduler's admin API) shows the proof: method, verified, device.
        doc = await ok(stack, "GET", f"/v1/slots/{slot_id}")
        last = doc["wipes"][0]
        assert last["outcome"] == "passed" and last["device"] == by_id, last
        assert last["report"]["proof"]["method"] in ("blkdiscard", "zero_fill") and last["report"]["proof"]["verified"]

    # The host's timeline (ops API) shows each slot's proof as its host reported it: device, method, verified.
    wipe_tasks = {proof["wipe_task"] for proof in freed_by.values()}

    async def on_timeline() -> list[dict[str, Any]] | None:
        tasks = [t for t in (await ops_host(stack))["tasks"] if t["task_id"] in wipe_tasks]
        return tasks if len(tasks) == len(wipe_tasks) and all(t["phases"] for t in tasks) else None

    timeline = await eventually(on_timeline, timeout=30, what=f"{HOST}'s wipes on the ops timeline")
    said = " ".join(p["detail"] for t in timeline for p in t["phases"] if p["phase"] == "wipe_reported")
    assert {t["status"] for t in timeline} == {"succeeded"}, timeline
    for slot_id, by_id in slots.items():
        method = freed_by[slot_id]["proof"]["method"]
        assert f"{slot_id} {by_id}: {method}, verified" in said, said

    # Back in slice mode, the host binds the slots' devices again; slices land once that binding passed parity.
    async def rebound() -> dict[str, Any] | None:
        binds = portal.spy.of_type("slice.vfio_apply", node_id=HOST, action="bind")
        return binds[-1]["payload"] if len(binds) > binds_before else None

    bind = await eventually(rebound, timeout=60, what=f"{HOST}'s VFIO binding on re-entering slice mode")
    await portal.spy.wait_type("node.parity_reported", task_id=bind["task_id"], timeout=60)

    # A slice allocation on every slot, each its own VM: the disk its VM was given holds none of the markers.
    allocs = [await portal.request("gpu_slice", gpus=1) for _ in slots]
    placed_on: dict[str, uuid.UUID] = {}
    for alloc in allocs:
        placed = (await portal.wait_state(alloc, "placed", timeout=90))["payload"]
        [slot] = placed["slots"]
        placed_on[slot["slot_id"]] = alloc
    assert set(placed_on) == set(slots)
    for alloc in allocs:
        await portal.wait_state(alloc, "active", timeout=120)
    domains = (await sim_hosts(stack))[HOST]["domains"]
    given = disks_given(domains)
    all_markers = list(markers.values())
    for slot_id, disk in disks.items():
        assert disk in given, f"no VM on {HOST} was given {slot_id}'s disk {disk}: {domains}"
        for marker in all_markers:
            assert marker_found_at(disk, marker) == [], f"{slot_id}'s slice tenant reads a baremetal tenant's marker"

    for alloc in allocs:
        await portal.release(alloc)
    for alloc in allocs:
        await portal.wait_state(alloc, "released", timeout=120)
