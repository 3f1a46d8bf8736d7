"""The inventory admin's node, quota, drift, site wipe policy, steering and force-release actions through an
in-memory unit of work (tests/fakes/scheduler.py's repositories, held to the Postgres ones by
test_scheduler_repository_contract.py): each refusal with its status, code and details, writing nothing, and what
each change writes, audits and raises. Every event is checked against the contract on the subject it goes out on."""

from __future__ import annotations

import uuid
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest

from gpuaas_common.contract.asyncapi import default_validator
from gpuaas_common.unit_of_work import FakeUnitOfWork
from gpuaas_scheduler.service_layer import admin, steering
from gpuaas_scheduler.service_layer.admin import drift as drift_ops
from tests.fakes.scheduler import Claim, Slot, World, fake_repositories

ALLOC = uuid.UUID("00000000-0000-4000-8000-000000000001")


def _disk(slot_id: str) -> str:
    return f"/dev/disk/by-id/nvme-{slot_id}"


def _world() -> World:
    """Slice host h1 in region r1 (slots s0 available, s1 active, s2 cleanup, s3 retired); baremetal bm1."""
    world = World()
    for node in ("h1", "bm1"):
        world.nodes.add(node)
        world.regions[node] = "r1"
    world.row("h1").declared = {"kind": "slice_host", "sku": "h200"}
    world.row("bm1").declared = {"kind": "baremetal", "sku": "b200"}
    world.row("bm1").mode = "baremetal"
    for slot_id, status in (("s0", "available"), ("s1", "active"), ("s2", "cleanup"), ("s3", "retired")):
        world.slots[slot_id] = Slot(slot_id, "h1", status, _disk(slot_id))
    return world


async def _run(world: World, command: Any, *args: Any) -> tuple[Any, list[tuple[str, dict[str, Any]]]]:
    """One command in a unit of work, committed: its answer and its events (type, payload), each valid."""
    async with FakeUnitOfWork(fake_repositories(world), "scheduler") as uow:
        out = await command(uow, *args)
        await uow.commit()
    events = []
    for p in uow.events.pending:
        default_validator().validate(p.subject, p.envelope.model_dump(mode="json"))
        events.append((p.envelope.type, p.envelope.payload))
    return out, events


async def _refused(world: World, command: Any, *args: Any) -> admin.AdminError:
    async with FakeUnitOfWork(fake_repositories(world), "scheduler") as uow:
        with pytest.raises(admin.AdminError) as err:
            await command(uow, *args)
    assert uow.events.pending == [] and not uow.committed
    return err.value


def _acted(**extra: Any) -> dict[str, Any]:
    return {"actor": "ops", "reason": "ticket 9", **extra}


# --- refusals, each writing nothing ----------------------------------------------------------------------------

IN_A_DAY = datetime.now(timezone.utc) + timedelta(days=1)

REFUSALS = [
    ("force_release: not a UUID", admin.force_release, ("nope", admin.ForceReleaseIn(**_acted())), 422,
     "invalid_allocation_id", None),
    ("force_release: no live claims", admin.force_release, (str(uuid.uuid4()), admin.ForceReleaseIn(**_acted())), 404,
     "no_live_claims", None),
    ("quota: tenant not an identifier", admin.set_quota, ("-x", admin.QuotaIn(**_acted(max_gpus=4))), 422,
     "invalid_tenant", None),
    ("wipe policy: region not a site name", admin.set_site_wipe_policy,
     ("r/1", admin.SiteWipePolicyIn(**_acted(destructive_wipe_policy="nvme_format"))), 422, "invalid_region", None),
    ("waiver: no such node", admin.add_waiver, ("nope", admin.WaiverIn(actor="ops", gate="parity", reason="x",
     expires_at=IN_A_DAY)), 404, "node_not_found", None),
    ("waiver: no reason, no expiry", admin.add_waiver, ("h1", admin.WaiverIn(actor="ops", gate="parity")), 422,
     "waiver_refused", {"problems": ["a waiver needs a reason", "a waiver needs an expiry (expires_at)"]}),
    ("waiver: expired", admin.add_waiver, ("h1", admin.WaiverIn(actor="ops", gate="preflight", reason="x",
     expires_at=IN_A_DAY - timedelta(days=2))), 422, "waiver_refused",
     {"problems": ["expires_at is not in the future"]}),
    ("registration: a mode change", admin.upsert_node, (admin.NodeIn(actor="ops", node_id="h1", kind="slice_host",
     hostname="h1", sku="h200", mode="baremetal"),), 409, "mode_transition_refused",
     {"from": "slice", "to": "baremetal"}),
    ("drift ack: no such node", drift_ops.ack_drift, ("nope", drift_ops.DriftAckIn(**_acted())), 404,
     "node_not_found", None),
    ("drift ack: an id not the node's", drift_ops.ack_drift, ("h1", drift_ops.DriftAckIn(**_acted(drift_ids=[1, 7]))),
     404, "drift_not_found", {"drift_ids": [7]}),
    ("drift ack: an item not open", drift_ops.ack_drift, ("h1", drift_ops.DriftAckIn(**_acted(drift_ids=[1, 2]))),
     409, "drift_not_open", {"drift_ids": [2]}),
]  # fmt: skip


def _drift(world: World, drift_id: int, slot_id: str | None, status: str) -> None:
    at = datetime(2026, 1, 1, tzinfo=timezone.utc) + timedelta(minutes=drift_id)
    world.drift_rows.append(
        {"drift_id": drift_id, "node_id": "h1", "slot_id": slot_id, "kind": "gpu_missing", "subject": f"x{drift_id}",
         "detail": "gone", "devices": [], "status": status, "first_reported_at": at}
    )  # fmt: skip


@pytest.mark.parametrize(
    ("case", "command", "args", "status", "code", "details"), REFUSALS, ids=[r[0] for r in REFUSALS]
)
async def test_a_refused_admin_action_answers_its_reason_and_writes_nothing(
    case: str, command: Any, args: tuple[Any, ...], status: int, code: str, details: dict[str, Any] | None
) -> None:
    world = _world()
    _drift(world, 1, "s0", "open")
    _drift(world, 2, None, "acknowledged")
    err = await _refused(world, command, *args)
    assert (err.status, err.code) == (status, code)
    if details is not None:
        assert err.details == details
    assert world.audit == [] and world.waivers == [] and world.quotas == {} and world.site_policies == {}
    assert [d["status"] for d in world.drift_rows] == ["open", "acknowledged"]
    assert world.row("h1").mode == "slice"


async def test_a_drift_ack_with_nothing_open_is_refused() -> None:
    world = _world()
    _drift(world, 1, "s0", "resolved")
    err = await _refused(world, drift_ops.ack_drift, "h1", drift_ops.DriftAckIn(**_acted()))
    assert (err.status, err.code, err.message) == (409, "no_open_drift", "node 'h1' has no open drift to acknowledge")


# --- changes ---------------------------------------------------------------------------------------------------


async def test_a_quota_is_set_audited_and_answered_with_what_the_tenant_holds() -> None:
    world = _world()
    world.claims += [Claim(ALLOC, "h1", "s1", tenant_id="acme", gpus=2), Claim(ALLOC, "h1", None, "released", "acme")]
    out, events = await _run(world, admin.set_quota, "acme", admin.QuotaIn(**_acted(max_gpus=8)))
    assert (out["tenant_id"], out["quota"]["max_gpus"], out["quota"]["updated_by"], out["gpus_in_use"]) == (
        "acme",
        8,
        "ops",
        2,
    )
    assert events == []
    assert world.audit == [("ops", "tenant.quota", "acme", "ticket 9", {"max_gpus": 8})]
    unset = await admin.get_quota(fake_repositories(world).quotas, "other")
    assert unset == {"tenant_id": "other", "quota": None, "gpus_in_use": 0}


async def test_a_site_wipe_policy_is_recorded_on_the_regions_slots_and_names_those_in_use() -> None:
    world = _world()
    world.slots["x0"] = Slot("x0", "elsewhere", "available", _disk("x0"))
    world.claims.append(Claim(ALLOC, "h1", "s1"))
    world.site_policies["r1"] = {"region": "r1", "destructive_wipe_policy": "blkdiscard"}
    body = admin.SiteWipePolicyIn(**_acted(destructive_wipe_policy="nvme_format"))
    out, _ = await _run(world, admin.set_site_wipe_policy, "r1", body)
    assert (out["region"], out["site_policy"]["destructive_wipe_policy"]) == ("r1", "nvme_format")
    assert (out["slots_updated"], out["slots_in_use"]) == (["s0", "s1", "s2", "s3"], ["s1"])
    assert world.slots["x0"].wipe_policy == "blkdiscard"
    detail = {"policy": "nvme_format", "previous": "blkdiscard", "slots_updated": out["slots_updated"],
              "slots_in_use": ["s1"]}  # fmt: skip
    assert world.audit == [("ops", "site.wipe_policy", "r1", "ticket 9", detail)]


async def test_a_waiver_is_recorded_under_the_node_lock_and_shows_on_the_node() -> None:
    world = _world()
    body = admin.WaiverIn(actor="ops", gate="parity", reason="  vendor RMA  ", expires_at=IN_A_DAY)
    out, _ = await _run(world, admin.add_waiver, "h1", body)
    [waiver] = out["waivers"]
    assert (waiver["gate"], waiver["reason"], waiver["active"]) == ("parity", "vendor RMA", True)
    detail = {"waiver_id": waiver["waiver_id"], "gate": "parity", "expires_at": IN_A_DAY.isoformat()}
    assert world.audit == [("ops", "node.waiver", "h1", "  vendor RMA  ", detail)]


@pytest.mark.parametrize(
    ("kind", "tags", "mode", "first"),
    [
        ("slice_host", [], None, "slice"),
        ("baremetal", [], None, "baremetal"),
        ("slice_host", ["gpuaas-profile-slice-vm"], "baremetal", "baremetal"),
    ],
)
async def test_a_new_node_registers_with_its_first_mode_and_its_history_begins(
    kind: str, tags: list[str], mode: str | None, first: str
) -> None:
    world = _world()
    body = admin.NodeIn(actor="ops", node_id="n9", kind=kind, hostname="n9.lab", sku="h200", maas_tags=tags, mode=mode)
    out, _ = await _run(world, admin.upsert_node, body)
    assert (out["node"]["node_id"], out["node"]["mode"], out["node"]["hostname"]) == ("n9", first, "n9.lab")
    intent = "slice-vm" if tags else "baremetal"
    assert world.row("n9").declared["profile_intent"] == intent
    assert out["mode_history"] == [
        {"from_mode": None, "to_mode": first, "actor": "ops", "reason": "registered through the admin API"}
    ]
    assert world.audit == [("ops", "node.upsert", "n9", None, body.model_dump(exclude={"actor"}))]
    assert world.refreshed == [["n9"]]


async def test_a_registered_node_is_updated_but_keeps_its_mode_and_history() -> None:
    world = _world()
    body = admin.NodeIn(actor="ops", node_id="h1", kind="slice_host", hostname="h1.new", sku="h200", mode="slice")
    out, _ = await _run(world, admin.upsert_node, body)
    assert (out["node"]["hostname"], out["node"]["mode"], out["mode_history"]) == ("h1.new", "slice", [])


async def test_drift_is_listed_by_status_and_an_ack_puts_the_items_back() -> None:
    world = _world()
    _drift(world, 1, "s0", "open")
    _drift(world, 2, None, "open")
    _drift(world, 3, "s1", "resolved")
    drift = fake_repositories(world).drift_log
    listed = await drift_ops.list_drift(drift, "h1")
    assert ([d["drift_id"] for d in listed["drift"]], listed["drift_open"]) == ([1, 2], True)
    assert [d["drift_id"] for d in (await drift_ops.list_drift(drift, "h1", "resolved"))["drift"]] == [3]
    assert [d["drift_id"] for d in (await drift_ops.list_drift(drift, "h1", "all"))["drift"]] == [1, 2, 3]
    out, _ = await _run(world, drift_ops.ack_drift, "h1", drift_ops.DriftAckIn(**_acted()))
    assert (out["acknowledged"], out["drift_open"]) == ([1, 2], False)
    assert [d["status"] for d in out["drift"]] == ["acknowledged", "acknowledged"]
    detail = {"drift_ids": [1, 2], "slot_ids": ["(node)", "s0"]}
    assert world.audit == [("ops", "node.drift_ack", "h1", "ticket 9", detail)]
    with pytest.raises(admin.AdminError) as err:
        await drift_ops.list_drift(drift, "nope")
    assert err.value.code == "node_not_found"


@pytest.mark.parametrize("read", [admin.get_node, admin.get_mode])
async def test_a_read_of_an_unknown_node_is_a_404(read: Any) -> None:
    with pytest.raises(admin.AdminError) as err:
        await read(fake_repositories(_world()).node_admin, "nope")
    assert (err.value.status, err.value.code, err.value.message) == (404, "node_not_found", "no node 'nope'")


async def test_nodes_are_listed_by_region_and_sku_and_a_mode_view_names_its_ways_out() -> None:
    nodes = fake_repositories(_world()).node_admin
    assert [n["node_id"] for n in (await admin.list_nodes(nodes))["nodes"]] == ["bm1", "h1"]
    assert [n["node_id"] for n in (await admin.list_nodes(nodes, sku="h200"))["nodes"]] == ["h1"]
    assert (await admin.list_nodes(nodes, region="r2"))["nodes"] == []
    mode = await admin.get_mode(nodes, "h1")
    assert (mode["node_id"], mode["mode"], sorted(mode["transitions"])) == ("h1", "slice", ["drained"])


# --- steering --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raised", "status", "code"),
    [(steering.UnknownNode("h1"), 404, "node_not_found"), (steering.AskRefused("h1", "parity", ["busy"]), 409,
      "ask_refused")],
)  # fmt: skip
async def test_a_refused_ask_of_a_host_is_answered_with_its_reasons(raised: Exception, status: int, code: str) -> None:
    async def ask(node_id: str, kind: str, *, actor: str, reason: str) -> dict[str, Any]:
        raise raised

    world = _world()
    err = await _refused(world, admin.steer, ask, "h1", "parity", admin.Acted(**_acted()))
    assert (err.status, err.code) == (status, code)
    if code == "ask_refused":
        assert err.details == {"kind": "parity", "problems": ["busy"]}
    assert world.audit == []
    assert (await _refused(world, admin.steer, ask, "nope", "parity", admin.Acted(**_acted()))).code == "node_not_found"


async def test_an_ask_of_a_host_is_audited_and_answered_with_the_node_and_the_ask() -> None:
    asked: list[tuple[str, str, str, str]] = []

    async def ask(node_id: str, kind: str, *, actor: str, reason: str) -> dict[str, Any]:
        asked.append((node_id, kind, actor, reason))
        return {"action_id": "parity-1", "node_id": node_id, "kind": kind, "result": None}

    world = _world()
    out, _ = await _run(world, admin.steer, ask, "h1", "parity", admin.Acted(**_acted()))
    assert asked == [("h1", "parity", "ops", "ticket 9")]
    assert (out["node"]["node_id"], out["action"]) == (
        "h1",
        {"action_id": "parity-1", "node_id": "h1", "kind": "parity", "result": {}},
    )
    assert world.audit == [("ops", "node.parity", "h1", "ticket 9", {"action_id": "parity-1"})]


# --- force-release ---------------------------------------------------------------------------------------------


async def test_a_force_release_while_a_vm_may_hold_the_devices_is_refused_with_the_evidence() -> None:
    world = _world()
    world.claims += [Claim(ALLOC, "h1", "s1"), Claim(ALLOC, "h1", "s2")]
    err = await _refused(world, admin.force_release, str(ALLOC), admin.ForceReleaseIn(**_acted()))
    assert (err.status, err.code) == (409, "vm_may_hold_devices")
    assert err.details == {"holders": ["slot s1 is active: the allocation's VM may still hold its GPU and disk"]}
    assert [c.status for c in world.claims] == ["held", "held"] and world.log == [] and world.audit == []


async def test_a_forced_release_blocks_the_slots_frees_the_claims_and_tells_the_allocator() -> None:
    world = _world()
    world.claims += [Claim(ALLOC, "h1", "s1"), Claim(ALLOC, "h1", "s2"), Claim(ALLOC, "h1", "s3")]
    out, events = await _run(world, admin.force_release, str(ALLOC), admin.ForceReleaseIn(**_acted(force=True)))
    holders = ["slot s1 is active: the allocation's VM may still hold its GPU and disk"]
    assert out == {
        "allocation_id": str(ALLOC),
        "forced": True,
        "holders": holders,
        "claims_released": 3,
        "slots": {"s1": "cleanup_blocked", "s2": "cleanup_blocked"},
        "untouched": {"s3": "retired"},
        "drained_nodes": [],
    }
    why = "force-released by ops: ticket 9"
    assert [(s.status, s.health, s.health_detail) for s in (world.slots["s1"], world.slots["s2"])] == [
        ("cleanup_blocked", "failed", why)
    ] * 2
    assert all(c.status == "released" for c in world.claims)
    detail = {"force_release": "ticket 9", "forced": True, "holders": holders}
    assert [(s, f, t) for s, f, t, _a, _d in world.log] == [("s1", "active", "cleanup_blocked"),
                                                          ("s2", "cleanup", "cleanup_blocked")]  # fmt: skip
    assert world.log[0][4] == detail
    trail = {**detail, "slots": ["s1", "s2"], "untouched": {"s3": "retired"}, "drained": []}
    assert world.audit == [("ops", "allocation.force_release", str(ALLOC), "ticket 9", trail)]
    (announced_type, announced), (told_type, told) = events
    assert (announced_type, announced["node_id"], announced["cause"]) == (
        "scheduler.slots_changed",
        "h1",
        "force_release",
    )
    assert told_type == "placement.force_released"
    assert (told["node_ids"], told["slot_ids"], told["forced"], told["holders"]) == (
        ["h1"],
        ["s1", "s2"],
        True,
        holders,
    )


async def test_a_forced_release_of_a_machine_held_whole_drains_it_and_moves_no_slot() -> None:
    world = _world()
    world.claims.append(Claim(ALLOC, "bm1", None))
    refused = await _refused(world, admin.force_release, str(ALLOC), admin.ForceReleaseIn(**_acted()))
    assert refused.details["holders"] == ["node bm1 is held whole: the machine may still be deployed to the tenant"]
    out, events = await _run(world, admin.force_release, str(ALLOC), admin.ForceReleaseIn(**_acted(force=True)))
    assert (out["drained_nodes"], out["slots"], out["claims_released"]) == (["bm1"], {}, 1)
    assert world.drained == {"bm1": "force-released by ops: ticket 9"}
    assert [t for t, _p in events] == ["placement.force_released"]  # no slot moved: nothing to announce
