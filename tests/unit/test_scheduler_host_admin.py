"""The host's admin commands (drain, undrain, the mode) through an in-memory unit of work: each is load, one
`Host` method, save, and its events raised in the same unit of work (tests/fakes/scheduler.py's repositories,
held to the Postgres ones by test_scheduler_repository_contract.py). Every event is checked against the contract
on the subject it would go out on."""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from gpuaas_common.contract import spec_for
from gpuaas_common.contract.asyncapi import default_validator
from gpuaas_common.unit_of_work import FakeUnitOfWork
from gpuaas_scheduler.service_layer.admin import Acted, AdminError, DrainIn, ModeIn, drain, set_mode, undrain
from gpuaas_scheduler.service_layer.host_modes import return_from_baremetal
from tests.fakes.scheduler import Claim, FakeHosts, Slot, World, fake_repositories

GPU = "0000:1b:00.0"


def _disk(slot_id: str) -> str:
    return f"/dev/disk/by-id/nvme-{slot_id}"


def _world(mode: str = "slice", **row: Any) -> World:
    """A slice host h1: an available slot (its GPU passed through), a disabled one, a retired one, one in use."""
    world = World()
    world.nodes.add("h1")
    world.row("h1").mode = mode
    world.row("h1").accepts_slices = True
    for k, v in row.items():
        setattr(world.row("h1"), k, v)
    for slot_id, status, gpu in (("s0", "available", GPU), ("s1", "disabled", None), ("s2", "retired", None)):
        world.slots[slot_id] = Slot(slot_id, "h1", status, _disk(slot_id), gpu_pci_address=gpu)
    world.slots["s3"] = Slot("s3", "h1", "active", _disk("s3"))
    return world


async def _run(world: World, command: Any, *args: Any) -> tuple[Any, list[tuple[str, str, dict[str, Any]]]]:
    """Run one command in a unit of work and commit it: its answer and its events (type, subject, payload), each
    valid by the contract."""
    async with FakeUnitOfWork(fake_repositories(world), "scheduler") as uow:
        out = await command(uow, *args)
        await uow.commit()
    events = []
    for p in uow.events.pending:
        default_validator().validate(p.subject, p.envelope.model_dump(mode="json"))
        events.append((p.envelope.type, p.subject, p.envelope.payload))
    return out, events


async def _refused(world: World, command: Any, *args: Any) -> AdminError:
    async with FakeUnitOfWork(fake_repositories(world), "scheduler") as uow:
        with pytest.raises(AdminError) as err:
            await command(uow, *args)
    assert uow.events.pending == [] and not uow.committed
    return err.value


# --- drain and undrain -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("maintenance", "row"),
    [(False, (True, "rack move", "ops", False, None)), (True, (True, "rack move", "ops", True, "rack move"))],
)
async def test_a_drain_stops_placements_and_a_maintenance_drain_says_so(maintenance: bool, row: tuple) -> None:
    world = _world()
    out, events = await _run(world, drain, "h1", DrainIn(actor="ops", reason="rack move", maintenance=maintenance))
    r = world.row("h1")
    assert (out, events) == ({}, [])
    assert (r.draining, r.drain_reason, r.drained_by, r.maintenance, r.maintenance_reason) == row
    assert world.audit == [("ops", "node.drain", "h1", "rack move", {"maintenance": maintenance})]
    assert [s.status for s in world.slots.values()] == ["available", "disabled", "retired", "active"]


@pytest.mark.parametrize("command", [drain, undrain, set_mode])
async def test_a_command_on_an_unknown_node_is_refused_and_writes_nothing(command: Any) -> None:
    world = _world()
    body = {drain: DrainIn(actor="ops", reason="x"), undrain: Acted(actor="ops", reason="x")}.get(
        command, ModeIn(actor="ops", reason="x", mode="drained")
    )
    err = await _refused(world, command, "nope", body)
    assert (err.status, err.code, err.message) == (404, "node_not_found", "no node 'nope'")
    assert world.audit == [] and world.row("h1").mode == "slice"


async def test_an_undrain_without_maintenance_changes_no_slot_and_asks_nothing() -> None:
    world = _world(draining=True, drain_reason="rack move", drained_by="ops")
    out, events = await _run(world, undrain, "h1", Acted(actor="ops", reason="done"))
    assert (out, events) == ({}, [])
    assert (world.row("h1").draining, world.row("h1").drain_reason) == (False, None)
    assert [s.status for s in world.slots.values()] == ["available", "disabled", "retired", "active"]
    assert world.wipes == [] and world.refreshed == []
    assert world.audit == [("ops", "node.undrain", "h1", "done", None)]


async def test_an_undrain_out_of_maintenance_asks_the_hosts_wipe_and_holds_its_free_slots_back() -> None:
    world = _world(draining=True, maintenance=True)
    world.claims.append(Claim(uuid.uuid4(), "h1", "s3"))
    out, events = await _run(world, undrain, "h1", Acted(actor="ops", reason="disks swapped"))
    task = out["wipe_task"]
    assert task.startswith("wipe-")
    assert out == {"wipe_task": task, "awaiting_wipe": ["s0"], "wipe_asked": ["s0", "s1"]}
    assert [s.status for s in world.slots.values()] == ["awaiting_wipe", "disabled", "retired", "active"]
    assert world.slots["s0"].reason == (
        "awaiting the host agent's wipe proof: back from maintenance: its disk may have been swapped or touched"
    )
    detail = {"cause": "maintenance", "wipe_task": task, "undrain_reason": "disks swapped"}
    assert world.log == [("s0", "available", "awaiting_wipe", None, detail)]
    assert [(w.task_id, w.slot_id, w.device, w.policy, w.cause) for w in world.wipes] == [
        (task, s, _disk(s), "blkdiscard", "maintenance") for s in ("s0", "s1")
    ]
    assert world.wipes[0].why.startswith("undrain by ops after maintenance: disks swapped; back from maintenance")
    assert world.refreshed == [["h1"]]
    (wipe_type, wipe_subject, wipe), (slots_type, _s, slots) = events
    assert (wipe_type, wipe_subject, wipe["task_id"]) == (
        "slice.slot_wipe",
        spec_for(wipe_type).subject(node_id="h1"),
        task,
    )
    assert [(s["slot_id"], s["nvme_by_id"], s["wipe_policy"]) for s in wipe["slots"]] == [
        (s, _disk(s), "blkdiscard") for s in ("s0", "s1")
    ]
    assert (slots_type, slots["cause"], slots["actor"]) == ("scheduler.slots_changed", "maintenance", "ops")
    assert [(s["slot_id"], s["status"]) for s in slots["slots"]][0] == ("s0", "awaiting_wipe")
    assert world.audit == [("ops", "node.undrain", "h1", "disks swapped", {"maintenance": True, **out})]
    assert (world.row("h1").draining, world.row("h1").maintenance) == (False, False)


async def test_an_undrain_out_of_maintenance_with_no_disk_to_wipe_asks_nothing() -> None:
    world = _world(draining=True, maintenance=True)
    for slot in world.slots.values():
        slot.nvme_by_id = "/dev/nvme0n1"  # no stable identity: no disk the agent may wipe
    out, events = await _run(world, undrain, "h1", Acted(actor="ops", reason="done"))
    assert (out, events) == ({"wipe_task": None, "awaiting_wipe": [], "wipe_asked": []}, [])
    assert world.wipes == [] and world.slots["s0"].status == "available"
    assert world.audit == [("ops", "node.undrain", "h1", "done", {"maintenance": True, **out})]


# --- the mode --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("frm", "to", "vfio"),
    [
        ("drained", "slice", "bind"),  # entering slice mode binds the approved slots' GPUs
        ("slice", "drained", None),  # both modes keep the devices bound
    ],
)
async def test_a_mode_change_is_recorded_announced_and_asks_the_binding_it_calls_for(
    frm: str, to: str, vfio: str | None
) -> None:
    world = _world(frm, parity_failures=0)
    out, events = await _run(world, set_mode, "h1", ModeIn(actor="ops", reason="ticket 7", mode=to))
    assert out == {}
    assert world.row("h1").mode == to
    [change] = world.row("h1").history
    assert (change.from_mode, change.to_mode, change.actor, change.reason) == (frm, to, "ops", "ticket 7")
    types = [t for t, _s, _p in events]
    assert types == (["slice.vfio_apply"] if vfio else []) + ["scheduler.host_mode_changed"]
    announced = events[-1][2]
    assert (announced["node_id"], announced["from_mode"], announced["to_mode"]) == ("h1", frm, to)
    detail: dict[str, Any] = {"from": frm, "to": to, "evidence_reset": False}
    if vfio:
        task = events[0][2]
        assert (task["action"], [s["slot_id"] for s in task["slots"]]) == (vfio, ["s0"])
        detail["vfio_task"] = task["task_id"]
    assert world.audit == [("ops", "node.mode", "h1", "ticket 7", detail)]


@pytest.mark.parametrize(
    ("frm", "to", "problems", "claims"),
    [
        ("slice", "baremetal", None, 0),  # no transition: the detour is named
        (
            "drained",
            "retired",
            [
                "1 live claim(s) on the host: wait for their allocations to be released",
                "3 approved slot(s) not retired: retire them first (POST /v1/nodes/{node_id}/slots/retire); "
                "a cleanup_blocked slot needs a verified wipe first",
            ],
            1,
        ),
        ("slice", "slice", ["the host is already slice"], 0),
    ],
)
async def test_a_refused_mode_change_is_a_409_naming_every_problem_and_writes_nothing(
    frm: str, to: str, problems: list[str] | None, claims: int
) -> None:
    world = _world(frm, parity_failures=0)
    for _ in range(claims):
        world.claims.append(Claim(uuid.uuid4(), "h1", "s3"))
    err = await _refused(world, set_mode, "h1", ModeIn(actor="ops", reason="try", mode=to))
    assert (err.status, err.code) == (409, "mode_transition_refused")
    assert err.message.startswith(f"h1: {frm} → {to} refused: ")
    assert (err.details["from"], err.details["to"]) == (frm, to)
    if problems is not None:
        assert err.details["problems"] == problems
    assert (
        err.details["allowed"]
        == {"slice": ["drained"], "drained": ["slice", "baremetal", "converting", "retired"]}[frm]
    )
    assert world.row("h1").mode == frm and world.row("h1").history == [] and world.audit == []


# --- back from a baremetal tenancy -----------------------------------------------------------------------------


@pytest.mark.parametrize(("slices", "after"), [(True, "converting"), (False, "baremetal")])
async def test_a_host_released_from_baremetal_converts_only_where_it_takes_slices(slices: bool, after: str) -> None:
    world = World()
    world.nodes.add("bm1")
    world.row("bm1").mode, world.row("bm1").accepts_slices, world.row("bm1").parity_failures = "baremetal", slices, 0
    alloc = uuid.uuid4()
    assert await return_from_baremetal(FakeHosts(world), "bm1", alloc) == after
    history = [(h.from_mode, h.to_mode, h.actor, h.allocation_id, h.resets_evidence) for h in world.row("bm1").history]
    assert history == ([("baremetal", "converting", "scheduler", str(alloc), True)] if slices else [])
    assert world.row("bm1").parity_failures == (None if slices else 0)  # the redeployed host's evidence is unknown
