"""The scheduler's repositories (adapters/repository.py: ClaimRepository, SlotRepository, AuditRepository;
adapters/hosts.py: HostRepository, the `Host` aggregate; adapters/admin.py: the inventory admin's nodes, quotas,
drift, site wipe policies and force-releases), one contract test each, run against the handler tests'
fakes (tests/fakes/scheduler.py) and Postgres alike, through one parametrised fixture, as the allocator's are
(test_allocator_repository_contract.py). The scheduler's rows are arranged by each backend's own hands (a node, its
columns, its slots, an allocation's claims), since placement, which writes them in production, is no
repository's; what is read back goes through the repositories."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any

import asyncpg
import pytest

from gpuaas_common.unit_of_work import FakeUnitOfWork, UnitOfWork
from gpuaas_scheduler.adapters.repository import scheduler_repositories
from gpuaas_scheduler.domain.drift import Item
from gpuaas_scheduler.domain.host import EvidenceTimes, HostSlot
from gpuaas_scheduler.domain.host_mode import HostFacts, ModeRefused
from gpuaas_scheduler.domain.node_claims import HeldClaim, NodeDrained, SlotsMoved
from tests.fakes.scheduler import Claim, Slot, World, fake_repositories

from .scheduler_db import scheduler_pool


@dataclass
class Backend:
    """One implementation: its units of work, how it is arranged, and what its tables hold for the checks that
    no repository method reads (the transition log, a node's drain)."""

    name: str
    unit_of_work: Callable[[], Any]
    add_node: Callable[[str], Awaitable[None]]
    add_slot: Callable[[str, str, str], Awaitable[None]]  # slot, node, status
    add_claim: Callable[[uuid.UUID, str, str | None], Awaitable[None]]  # allocation, node, slot (None: whole)
    slot_status: Callable[[str], Awaitable[str]]
    log: Callable[[uuid.UUID], Awaitable[list[tuple[str, str, str]]]]  # (slot, from, to) in order
    drain_reason: Callable[[str], Awaitable[str | None]]
    # The host's: its node row's columns, a slot with its approval and devices, and what no `get` reads back.
    set_node: Callable[..., Awaitable[None]]  # node, column=value...
    add_host_slot: Callable[..., Awaitable[None]]  # slot, node, status, approved_at=, gpu_pci_address=
    drain_row: Callable[[str], Awaitable[tuple[Any, ...]]]  # draining, reason, by, maintenance, maintenance reason
    wipe_asks: Callable[[str], Awaitable[list[tuple[Any, ...]]]]  # task, slot, device, policy, cause, by, open
    mode_history: Callable[[str], Awaitable[list[tuple[Any, ...]]]]  # from, to, actor, reason, evidence reset
    audit: Callable[[str], Awaitable[list[tuple[Any, ...]]]]  # actor, action, reason, detail
    # The inventory admin's: a tenant's claim of some GPUs, and a drift item as a report leaves it (its id).
    add_tenant_claim: Callable[[uuid.UUID, str, str, str, int], Awaitable[None]]  # alloc, node, slot, tenant, gpus
    add_drift: Callable[[str, str | None, str, str], Awaitable[int]]  # node, slot (None: the node), subject, status


_TAGS = {"accepts_slices": "gpuaas-profile-slice-vm", "accepts_baremetal": "gpuaas-profile-baremetal"}


def _disk(slot_id: str) -> str:
    return f"/dev/disk/by-id/nvme-{slot_id}"


def _fake() -> Backend:
    world = World()
    repos = fake_repositories(world)

    async def add_node(node: str) -> None:
        world.nodes.add(node)
        world.regions[node] = "r"

    async def add_slot(slot: str, node: str, status: str) -> None:
        world.slots[slot] = Slot(slot, node, status, _disk(slot))

    async def add_claim(alloc: uuid.UUID, node: str, slot: str | None) -> None:
        world.claims.append(Claim(alloc, node, slot))

    async def slot_status(slot: str) -> str:
        return world.slots[slot].status

    async def log(alloc: uuid.UUID) -> list[tuple[str, str, str]]:
        return [(s, f, t) for s, f, t, a, _d in world.log if a == alloc]

    async def drain_reason(node: str) -> str | None:
        return world.drained.get(node)

    async def set_node(node: str, **cols: Any) -> None:
        for k, v in cols.items():
            setattr(world.row(node), k, v)

    async def add_host_slot(slot: str, node: str, status: str, **cols: Any) -> None:
        world.slots[slot] = Slot(slot, node, status, _disk(slot), **cols)

    async def drain_row(node: str) -> tuple[Any, ...]:
        r = world.row(node)
        return (r.draining, r.drain_reason, r.drained_by, r.maintenance, r.maintenance_reason)

    async def wipe_asks(node: str) -> list[tuple[Any, ...]]:
        return [
            (w.task_id, w.slot_id, w.device, w.policy, w.cause, w.requested_by, w.outcome is None)
            for w in world.wipes
            if w.node_id == node
        ]

    async def mode_history(node: str) -> list[tuple[Any, ...]]:
        return [(h.from_mode, h.to_mode, h.actor, h.reason, h.resets_evidence) for h in world.row(node).history]

    async def audit(target: str) -> list[tuple[Any, ...]]:
        return [(a, act, why, detail) for a, act, t, why, detail in world.audit if t == target]

    async def add_tenant_claim(alloc: uuid.UUID, node: str, slot: str, tenant: str, gpus: int) -> None:
        world.claims.append(Claim(alloc, node, slot, tenant_id=tenant, gpus=gpus))

    async def add_drift(node: str, slot: str | None, subject: str, status: str) -> int:
        drift_id = len(world.drift_rows) + 1
        at = datetime.now(timezone.utc) + timedelta(seconds=drift_id)
        world.drift_rows.append(
            {"drift_id": drift_id, "node_id": node, "slot_id": slot, "kind": "gpu_missing", "subject": subject,
             "detail": "gone", "devices": [], "status": status, "first_reported_at": at}
        )  # fmt: skip
        return drift_id

    return Backend(
        "fake",
        lambda: FakeUnitOfWork(repos, "scheduler"),
        add_node,
        add_slot,
        add_claim,
        slot_status,
        log,
        drain_reason,
        set_node,
        add_host_slot,
        drain_row,
        wipe_asks,
        mode_history,
        audit,
        add_tenant_claim,
        add_drift,
    )


def _postgres(pool: asyncpg.Pool) -> Backend:
    async def add_node(node: str) -> None:
        await pool.execute(
            "INSERT INTO nodes (node_id, kind, hostname, region, pool, sku, profile_intent) "
            "VALUES ($1, 'slice_host', $1, 'r', 'p', 'h200', 'slice-vm')",
            node,
        )

    async def add_slot(slot: str, node: str, status: str) -> None:
        await pool.execute(
            "INSERT INTO node_resource_slots (slot_id, node_id, nvme_by_id, profile, status) "
            "VALUES ($1, $2, $3, 'h200_1g', $4)",
            slot,
            node,
            _disk(slot),
            status,
        )

    async def add_claim(alloc: uuid.UUID, node: str, slot: str | None) -> None:
        await pool.execute(
            "INSERT INTO allocation_resource_claims (allocation_id, node_id, slot_id, claim_kind, status, "
            "fencing_epoch) VALUES ($1, $2, $3, $4, 'held', 1)",
            alloc,
            node,
            slot,
            "slot" if slot else "node_exclusive",
        )

    async def slot_status(slot: str) -> str:
        return await pool.fetchval("SELECT status FROM node_resource_slots WHERE slot_id = $1", slot)

    async def log(alloc: uuid.UUID) -> list[tuple[str, str, str]]:
        rows = await pool.fetch(
            "SELECT slot_id, from_status, to_status FROM slot_transitions WHERE allocation_id = $1 ORDER BY id", alloc
        )
        return [tuple(r) for r in rows]  # type: ignore[misc]

    async def drain_reason(node: str) -> str | None:
        return await pool.fetchval("SELECT drain_reason FROM nodes WHERE node_id = $1 AND draining", node)

    async def set_node(node: str, **cols: Any) -> None:
        tags = [t for k, t in _TAGS.items() if cols.pop(k, False)]
        if tags:
            cols["maas_tags"] = tags
        if "topology_reported" in cols:
            cols["topology_reported_at"] = datetime.now(timezone.utc) if cols.pop("topology_reported") else None
        sets = ", ".join(f"{k} = ${i + 2}" for i, k in enumerate(cols))
        await pool.execute(f"UPDATE nodes SET {sets} WHERE node_id = $1", node, *cols.values())

    async def add_host_slot(slot: str, node: str, status: str, **cols: Any) -> None:
        await add_slot(slot, node, status)
        if cols:
            sets = ", ".join(f"{k} = ${i + 2}" for i, k in enumerate(cols))
            await pool.execute(f"UPDATE node_resource_slots SET {sets} WHERE slot_id = $1", slot, *cols.values())

    async def drain_row(node: str) -> tuple[Any, ...]:
        return tuple(
            await pool.fetchrow(
                "SELECT draining, drain_reason, drained_by, maintenance, maintenance_reason FROM nodes "
                "WHERE node_id = $1",
                node,
            )
        )

    async def wipe_asks(node: str) -> list[tuple[Any, ...]]:
        rows = await pool.fetch(
            "SELECT task_id, slot_id, device, policy, cause, requested_by, closed_at IS NULL FROM slot_wipes "
            "WHERE node_id = $1 ORDER BY requested_at, slot_id",
            node,
        )
        return [tuple(r) for r in rows]

    async def mode_history(node: str) -> list[tuple[Any, ...]]:
        rows = await pool.fetch(
            "SELECT from_mode, to_mode, actor, reason, (detail->>'evidence_reset')::boolean FROM node_mode_history "
            "WHERE node_id = $1 ORDER BY id",
            node,
        )
        return [tuple(r) for r in rows]

    async def audit(target: str) -> list[tuple[Any, ...]]:
        rows = await pool.fetch(
            "SELECT actor, action, reason, detail FROM admin_audit WHERE target = $1 ORDER BY id", target
        )
        return [(r["actor"], r["action"], r["reason"], json.loads(r["detail"]) if r["detail"] else None) for r in rows]

    async def add_tenant_claim(alloc: uuid.UUID, node: str, slot: str, tenant: str, gpus: int) -> None:
        await pool.execute(
            "INSERT INTO allocation_resource_claims (allocation_id, node_id, slot_id, claim_kind, status, "
            "fencing_epoch, tenant_id, gpus) VALUES ($1, $2, $3, 'slot', 'held', 1, $4, $5)",
            alloc,
            node,
            slot,
            tenant,
            gpus,
        )

    async def add_drift(node: str, slot: str | None, subject: str, status: str) -> int:
        at = datetime.now(timezone.utc) + timedelta(seconds=await pool.fetchval("SELECT count(*) FROM node_drift") + 1)
        drift_id = await pool.fetchval(
            "INSERT INTO node_drift (node_id, slot_id, kind, subject, detail, status, first_reported_at, "
            "last_reported_at) VALUES ($1, $2, 'gpu_missing', $3, 'gone', $4, $5, $5) RETURNING drift_id",
            node,
            slot,
            subject,
            status,
            at,
        )
        await pool.execute(  # as a report leaves it
            "UPDATE nodes SET drift_open = EXISTS (SELECT 1 FROM node_drift d WHERE d.node_id = $1 "
            "AND d.slot_id IS NULL AND d.status = 'open') WHERE node_id = $1",
            node,
        )
        return drift_id

    return Backend(
        "postgres",
        lambda: UnitOfWork(pool, "scheduler", "scheduler", scheduler_repositories),
        add_node,
        add_slot,
        add_claim,
        slot_status,
        log,
        drain_reason,
        set_node,
        add_host_slot,
        drain_row,
        wipe_asks,
        mode_history,
        audit,
        add_tenant_claim,
        add_drift,
    )


@pytest.fixture
async def scheduler_db(fresh_db: str) -> AsyncIterator[asyncpg.Pool]:
    async with scheduler_pool(fresh_db) as pool:
        yield pool


@pytest.fixture(params=["fake", "postgres"])
def backend(request: pytest.FixtureRequest) -> Backend:
    """Sync, so that it may ask for the Postgres pool (an async fixture) only where it is the one asked for."""
    if request.param == "fake":
        return _fake()
    return _postgres(request.getfixturevalue("scheduler_db"))


async def _slices(backend: Backend, node: str = "n1", n: int = 2, status: str = "reserved") -> uuid.UUID:
    """An allocation holding `n` slots of `node`, as placement leaves them."""
    alloc = uuid.uuid4()
    await backend.add_node(node)
    for i in range(n):
        await backend.add_slot(f"{node}-s{i}", node, status)
        await backend.add_claim(alloc, node, f"{node}-s{i}")
    return alloc


# --- claims ----------------------------------------------------------------------------------------------------


async def test_an_allocations_live_claims_load_with_their_slots_and_what_the_log_shows(backend: Backend) -> None:
    alloc = await _slices(backend)
    whole = uuid.uuid4()
    await backend.add_node("bm1")
    await backend.add_claim(whole, "bm1", None)

    def held(status: str, reached: bool) -> tuple[HeldClaim, ...]:
        return tuple(
            HeldClaim("n1", "slot", f"n1-s{i}", status, _disk(f"n1-s{i}"), "blkdiscard", None, reached) for i in (0, 1)
        )

    async with backend.unit_of_work() as uow:
        await uow.repos.claims.lock_allocation(alloc)
        claims = await uow.repos.claims.load(alloc)
        assert (claims.allocation_id, claims.claims) == (str(alloc), held("reserved", False))
        assert (await uow.repos.claims.load(whole)).claims == (HeldClaim("bm1", "node_exclusive"),)
        assert (await uow.repos.claims.load(uuid.uuid4())).claims == ()
        assert await uow.repos.slots.move_for_allocation(alloc, "provisioning", ("reserved",)) == 2
        assert (await uow.repos.claims.load(alloc, log_reached="provisioning")).claims == held("provisioning", True)
        assert (await uow.repos.claims.load(alloc, log_reached="active")).claims == held("provisioning", False)
        await uow.commit()


async def test_a_saved_aggregate_moves_its_slots_drains_its_nodes_and_ends_its_claims(backend: Backend) -> None:
    alloc = await _slices(backend, status="active")
    async with backend.unit_of_work() as uow:
        claims = await uow.repos.claims.load(alloc)
        claims.changes += [
            SlotsMoved(("n1-s1", "n1-s0"), "cleanup_blocked", "wipe unproven", ("active",), detail={"why": "x"}),
            SlotsMoved(("n1-s0",), "available", "never moves: not from active", ("releasing",)),
            NodeDrained("n1", "cleanup required"),
        ]
        assert await uow.repos.claims.save(claims) == 0  # not released: its claims stay
        assert claims.changes == []
        claims.released = True
        assert await uow.repos.claims.save(claims) == 2
        assert (await uow.repos.claims.load(alloc)).claims == ()
        assert await uow.repos.claims.save(claims) == 0  # nothing live is left to end
        await uow.commit()
    assert [await backend.slot_status(s) for s in ("n1-s0", "n1-s1")] == ["cleanup_blocked", "cleanup_blocked"]
    assert await backend.log(alloc) == [("n1-s0", "active", "cleanup_blocked"), ("n1-s1", "active", "cleanup_blocked")]
    assert await backend.drain_reason("n1") == "cleanup required"


# --- slots -----------------------------------------------------------------------------------------------------


async def test_an_allocations_slots_move_only_from_the_statuses_named_and_each_move_is_logged(
    backend: Backend,
) -> None:
    alloc = await _slices(backend)
    other = await _slices(backend, node="n2", n=1)
    async with backend.unit_of_work() as uow:
        slots = uow.repos.slots
        assert await slots.statuses(alloc) == {"n1-s0": "reserved", "n1-s1": "reserved"}
        assert await slots.move_for_allocation(alloc, "active", ("provisioning",)) == 0
        assert await slots.move_for_allocation(alloc, "provisioning", ("reserved",)) == 2
        assert await slots.move_for_allocation(alloc, "provisioning", ("reserved",)) == 0
        assert await slots.statuses(alloc) == {"n1-s0": "provisioning", "n1-s1": "provisioning"}
        assert await slots.statuses(other) == {"n2-s0": "reserved"}
        assert await slots.statuses(uuid.uuid4()) == {}
        await uow.commit()
    assert await backend.log(alloc) == [("n1-s0", "reserved", "provisioning"), ("n1-s1", "reserved", "provisioning")]
    assert await backend.log(other) == []


async def test_a_hosts_announcements_are_numbered_and_carry_every_slot(backend: Backend) -> None:
    await _slices(backend, n=2, status="available")
    async with backend.unit_of_work() as uow:
        first = await uow.repos.slots.announcement("n1", "approval", "admin:" + "a" * 200)
        second = await uow.repos.slots.announcement("n1", "release", "scheduler")
        assert await uow.repos.slots.announcement("no-such-node", "release", "scheduler") is None
        await uow.commit()
    assert first is not None and second is not None
    assert (first.node_id, first.generation, first.cause, first.actor) == ("n1", 1, "approval", "admin:" + "a" * 122)
    assert (second.generation, second.cause) == (2, "release")
    assert [
        (s.slot_id, s.status, s.status_reason, s.health_state, s.health_detail, s.profile, s.nvme_by_id)
        for s in first.slots
    ] == [(f"n1-s{i}", "available", None, "healthy", None, "h200_1g", _disk(f"n1-s{i}")) for i in (0, 1)]


# --- hosts -----------------------------------------------------------------------------------------------------

RESET = datetime(2026, 1, 1, tzinfo=timezone.utc)
GPU = "0000:1b:00.0"


async def _drained_host(backend: Backend) -> uuid.UUID:
    """A drained slice host after an evidence reset: a re-approved available slot (its GPU passed through), a
    disabled one approved before the reset, a retired one, and one a live claim holds."""
    await backend.add_node("h1")
    await backend.set_node(
        "h1", mode="drained", accepts_slices=True, parity_failures=0, topology_reported=True, evidence_reset_at=RESET
    )
    later, earlier = RESET + timedelta(hours=1), RESET - timedelta(hours=1)
    await backend.add_host_slot("h1-s0", "h1", "available", approved_at=later, gpu_pci_address=GPU)
    await backend.add_host_slot("h1-s1", "h1", "disabled", approved_at=earlier)
    await backend.add_host_slot("h1-s2", "h1", "retired")
    await backend.add_host_slot("h1-s3", "h1", "active", approved_at=later)
    alloc = uuid.uuid4()
    await backend.add_claim(alloc, "h1", "h1-s3")
    return alloc


def _slot(slot_id: str, status: str, *, claimed: bool = False, wipe_open: bool = False, gpu: str | None = None):
    return HostSlot(slot_id, status, _disk(slot_id), "blkdiscard", claimed, wipe_open, gpu, None)


async def test_a_host_loads_with_its_mode_facts_its_drain_and_every_slot(backend: Backend) -> None:
    await _drained_host(backend)
    async with backend.unit_of_work() as uow:
        host = await uow.repos.hosts.get("h1")
        assert await uow.repos.hosts.get("no-such-node") is None
        await uow.commit()
    assert host is not None
    assert host.facts == HostFacts(
        node_id="h1",
        mode="drained",
        accepts_slices=True,
        accepts_baremetal=False,
        live_claims=1,
        unretired_slots=3,
        parity_failures=0,
        rediscovered=True,
        reapproved_slots=1,
        stale_slots=1,
    )
    assert (host.draining, host.maintenance, host.changes) == (False, False, [])
    assert host.slots == (
        _slot("h1-s0", "available", gpu=GPU),
        _slot("h1-s1", "disabled"),
        _slot("h1-s2", "retired"),
        _slot("h1-s3", "active", claimed=True),
    )
    assert host.now.tzinfo is not None


async def test_a_saved_host_writes_its_drain_its_wipe_asks_and_its_slots_moves(backend: Backend) -> None:
    await _drained_host(backend)
    async with backend.unit_of_work() as uow:
        host = await uow.repos.hosts.get("h1")
        assert host is not None
        host.drain("disk swap", actor="ops", maintenance=True)
        assert len(await uow.repos.hosts.save(host)) == 1 and host.changes == []
        await uow.commit()
    assert await backend.drain_row("h1") == (True, "disk swap", "ops", True, "disk swap")
    async with backend.unit_of_work() as uow:
        host = await uow.repos.hosts.get("h1")
        assert host is not None and (host.draining, host.maintenance) == (True, True)
        ended = host.undrain("swapped", actor="ops", wipe_task="wipe-t1")
        await uow.repos.hosts.save(host)
        await uow.repos.audit.record("ops", "node.undrain", "h1", "swapped", {"wipe_task": "wipe-t1"})
        again = await uow.repos.hosts.get("h1")
        await uow.commit()
    assert ended is not None and ended.view() == {
        "wipe_task": "wipe-t1",
        "awaiting_wipe": ["h1-s0"],
        "wipe_asked": ["h1-s0", "h1-s1"],
    }
    assert await backend.drain_row("h1") == (False, None, None, False, None)
    assert again is not None and (again.draining, again.maintenance) == (False, False)
    assert again.slots[:2] == (
        _slot("h1-s0", "awaiting_wipe", wipe_open=True, gpu=GPU),
        _slot("h1-s1", "disabled", wipe_open=True),
    )
    assert await backend.wipe_asks("h1") == [
        ("wipe-t1", s, _disk(s), "blkdiscard", "maintenance", "ops", True) for s in ("h1-s0", "h1-s1")
    ]
    assert await backend.audit("h1") == [("ops", "node.undrain", "swapped", {"wipe_task": "wipe-t1"})]


async def test_a_saved_mode_change_writes_the_mode_its_history_and_its_evidence_reset(backend: Backend) -> None:
    await backend.add_node("h2")
    await backend.set_node("h2", mode="retired", accepts_slices=True, parity_failures=0, topology_reported=True)
    async with backend.unit_of_work() as uow:
        host = await uow.repos.hosts.get("h2")
        assert host is not None
        with pytest.raises(ModeRefused):
            host.change_mode("slice", actor="ops", reason="no such transition")
        host.change_mode("converting", actor="ops", reason="back to slices")
        await uow.repos.hosts.save(host)
        again = await uow.repos.hosts.get("h2")
        await uow.commit()
    assert again is not None
    assert (again.mode, again.facts.parity_failures, again.facts.rediscovered) == ("converting", None, False)
    assert await backend.mode_history("h2") == [("retired", "converting", "ops", "back to slices", True)]


# --- evidence, steering, drift, wipes, walks (issue 39) ---------------------------------------------------------

T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)


async def test_a_hosts_reports_are_taken_only_when_newer_and_load_back_with_the_host(backend: Backend) -> None:
    await backend.add_node("h1")
    await backend.set_node("h1", parity_reported_at=T0, parity_failures=2)
    async with backend.unit_of_work() as uow:
        host = await uow.repos.hosts.get("h1")
        assert host is not None and host.evidence == EvidenceTimes(parity=T0)
        assert host.record_parity(failures=0, detail={"source": "x"}, checked_at=T0 - timedelta(seconds=1)) == "stale"
        assert host.record_parity(failures=0, detail={"source": "x"}, checked_at=T0 + timedelta(seconds=1)) == "applied"
        assert (
            host.record_topology(
                discovered_at=T0,
                blockers=["gpu 3 has no free disk"],
                hugepages_1g=(64, 60),
                fabric_manager=("shared_nvswitch", "550.1", True),
                candidates=[],
            )
            == "applied"
        )
        await uow.repos.hosts.save(host)
        again = await uow.repos.hosts.get("h1")
        await uow.commit()
    assert again is not None
    assert again.evidence == EvidenceTimes(parity=T0 + timedelta(seconds=1), topology=T0)
    assert (again.facts.parity_failures, again.facts.rediscovered) == (0, True)


async def test_a_drift_report_taken_opens_and_resolves_the_hosts_items(backend: Backend) -> None:
    await backend.add_node("h1")
    await backend.add_host_slot("h1-s0", "h1", "available", gpu_pci_address=GPU)
    item = (("disk_dirty", "d", "h1-s0"), Item("disk_dirty", "d", "found", (_disk("h1-s0"),)))
    for at, reported in ((T0, dict([item])), (T0 + timedelta(minutes=1), {})):
        async with backend.unit_of_work() as uow:
            slots = await uow.repos.drift.node_slots("h1")
            assert [(s["slot_id"], s["gpu_pci_address"], s["nvme_by_id"]) for s in slots] == [
                ("h1-s0", GPU, _disk("h1-s0"))
            ]
            host = await uow.repos.hosts.get("h1")
            assert host is not None
            held = await uow.repos.drift.held_keys("h1")
            change = host.record_drift(
                event_id=f"ev-{at.minute}", checked_at=at, report=[], reported=reported, held=held, keep=10
            )
            assert change is not None
            await uow.repos.hosts.save(host)
            after = await uow.repos.drift.held_keys("h1")
            await uow.commit()
        assert after == list(reported)
    async with backend.unit_of_work() as uow:
        host = await uow.repos.hosts.get("h1")
        assert host is not None and host.evidence.drift == T0 + timedelta(minutes=1)
        await uow.commit()


async def test_a_preflight_and_an_image_state_are_kept_and_applied_only_when_newest(backend: Backend) -> None:
    await backend.add_node("h1")
    await backend.set_node("h1", maas_system_id="sys-h1")
    row = {
        "operation_id": "pf-1",
        "site": "default",
        "system_id": "sys-h1",
        "result_set_id": None,
        "script_name": "50-gpuaas-slice-firmware-preflight",
        "script_status": None,
        "exit_status": None,
        "status": "passed",
        "reasons": [],
        "warnings": [],
        "checks": [],
        "nvme": [],
        "reported_at": T0,
    }
    async with backend.unit_of_work() as uow:
        ev = uow.repos.evidence
        assert await ev.node_for_machine("sys-h1", None) == "h1"
        assert await ev.node_for_machine("sys-other", "h1") == "h1"
        assert await ev.node_for_machine("sys-other", "ghost") is None
        assert await ev.insert_slice_preflight("h1", row) is True
        assert await ev.insert_slice_preflight("h1", row) is False
        assert await ev.update_preflight("h1", "passed", T0, "pf-1") is True
        assert await ev.update_preflight("h1", "failed", T0 - timedelta(hours=1), "pf-0") is False
        assert await ev.upsert_image_readiness("h1", "ubuntu-24", "pulling", None, False, T0) is True
        assert await ev.upsert_image_readiness("h1", "ubuntu-24", "verified", None, True, T0 + timedelta(1)) is True
        assert await ev.upsert_image_readiness("h1", "ubuntu-24", "failed", None, False, T0) is False
        await uow.commit()


async def test_a_wipe_ask_is_read_with_its_slot_closed_and_its_slot_moved(backend: Backend) -> None:
    await backend.add_node("h1")
    await backend.add_host_slot("h1-s0", "h1", "awaiting_wipe")
    async with backend.unit_of_work() as uow:
        wipes = uow.repos.wipes
        assert await wipes.lock_node("h1") is True and await wipes.lock_node("ghost") is False
        slot = {"slot_id": "h1-s0", "nvme_by_id": _disk("h1-s0"), "wipe_policy": "blkdiscard"}
        await wipes.open_asks("wipe-1", "h1", [slot], cause="approval", why="approved", actor="ops")
        [ask] = await wipes.open_asks_of_task("h1", "wipe-1")
        assert await wipes.open_asks_of_task("h1", "wipe-2") == []
        assert {k: ask[k] for k in ("slot_id", "device", "cause", "status", "nvme_by_id", "node_id", "claimed")} == {
            "slot_id": "h1-s0",
            "device": _disk("h1-s0"),
            "cause": "approval",
            "status": "awaiting_wipe",
            "nvme_by_id": _disk("h1-s0"),
            "node_id": "h1",
            "claimed": False,
        }
        assert ask["destructive_wipe_policy"] == "blkdiscard"
        await wipes.close("wipe-1", "h1-s0", outcome="passed", verdict="proven", report={"device": _disk("h1-s0")})
        await wipes.move_slot(
            "h1-s0",
            "available",
            None,
            actor="node:h1",
            only_from=["awaiting_wipe"],
            detail={},
            health=("healthy", "ok"),
        )
        await wipes.move_slot(
            "h1-s0", "cleanup_blocked", "x", actor="node:h1", only_from=["awaiting_wipe"], detail={}, health=None
        )
        assert await wipes.open_asks_of_task("h1", "wipe-1") == []
        await uow.commit()
    assert await backend.slot_status("h1-s0") == "available"
    assert await backend.wipe_asks("h1") == [
        ("wipe-1", "h1-s0", _disk("h1-s0"), "blkdiscard", "approval", "ops", False)
    ]


async def test_an_ask_of_a_host_is_recorded_once_and_answered_only_by_its_node(backend: Backend) -> None:
    await backend.add_node("h1")
    await backend.add_node("h2")
    async with backend.unit_of_work() as uow:
        asks = uow.repos.asks
        facts = await asks.facts("h1", "parity")
        assert facts is not None and (facts.node_kind, facts.mode, facts.open_ask) == ("slice_host", "slice", None)
        assert await asks.facts("ghost", "parity") is None
        row = await asks.insert("parity-1", "h1", "parity", "ops", "why", 600.0)
        assert row is not None and (row["action_id"], row["status"]) == ("parity-1", "requested")
        assert await asks.insert("parity-2", "h1", "parity", "ops", "why", 600.0) is None
        facts = await asks.facts("h1", "parity")
        assert facts is not None and facts.open_ask is not None and facts.open_ask.action_id == "parity-1"
        assert await asks.kind_of("parity-1", "h2") is None
        assert await asks.record_part("parity-1", "h2", "parity", {"a": 1}, ("succeeded", "ok")) is None
        assert await asks.record_part("parity-1", "h1", "parity", {"a": 1}, ("succeeded", "ok")) == "parity"
        got = await asks.get("parity-1")
        assert got is not None and (got["status"], got["outcome"]) == ("succeeded", "ok")
        result = got["result"]
        assert (json.loads(result) if isinstance(result, str) else result) == {"parity": {"a": 1}}
        await uow.commit()


# --- the inventory admin: nodes, quotas, drift, site wipe policies, force-release ------------------------------


def _pick(row: dict[str, Any] | None, *keys: str) -> tuple[Any, ...] | None:
    return None if row is None else tuple(row[k] for k in keys)


def _registration(node_id: str, **over: Any) -> dict[str, Any]:
    return {
        "node_id": node_id,
        "kind": "slice_host",
        "hostname": f"{node_id}.lab",
        "region": "r2",
        "pool": "p",
        "sku": "h200",
        "maas_system_id": None,
        "profile_intent": "slice-vm",
        "maas_tags": [],
        "mode": "slice",
        "gpu_count": 8,
        **over,
    }


NODE_KEYS = ("node_id", "kind", "hostname", "region", "sku", "mode", "draining", "maintenance")


async def test_a_node_registers_once_with_its_mode_and_is_listed_viewed_and_locked(backend: Backend) -> None:
    async with backend.unit_of_work() as uow:
        nodes = uow.repos.node_admin
        assert (await nodes.lock("n7"), await nodes.lock_mode("n7"), await nodes.view("n7")) == (False, None, None)
        await nodes.register(_registration("n7"))
        await nodes.record_created("n7", "ops", "registered")
        await nodes.register(_registration("n8", sku="b200", kind="baremetal", mode="baremetal"))
        await nodes.register(_registration("n7", hostname="n7.new", mode="baremetal"))  # its mode stays
        assert (await nodes.lock("n7"), await nodes.lock_mode("n7")) == (True, "slice")
        view = await nodes.view("n7")
        listed = [_pick(n, "node_id", "sku") for n in await nodes.listing("r2", None)]
        by_sku = [n["node_id"] for n in await nodes.listing(None, "b200")]
        history = [_pick(h, "from_mode", "to_mode", "actor", "reason") for h in await nodes.mode_history("n7")]
        record = _pick(await nodes.mode_record("n7"), "mode_changed_by", "mode_reason")
        modes = await nodes.modes("n7")
        assert await nodes.modes("nope") is None and await nodes.mode_record("nope") is None
        now = await nodes.now()
        await uow.commit()
    assert _pick(view, *NODE_KEYS) == ("n7", "slice_host", "n7.new", "r2", "h200", "slice", False, False)
    assert (listed, by_sku) == ([("n7", "h200"), ("n8", "b200")], ["n8"])
    assert (history, record) == ([(None, "slice", "ops", "registered")], ("ops", "registered"))
    assert modes is not None and modes.facts == HostFacts(
        node_id="n7",
        mode="slice",
        accepts_slices=False,
        accepts_baremetal=False,
        live_claims=0,
        unretired_slots=0,
        parity_failures=None,
        rediscovered=False,
        reapproved_slots=0,
        stale_slots=0,
    )
    assert now.tzinfo is not None


async def test_a_nodes_waivers_and_live_claims_read_back(backend: Backend) -> None:
    alloc = await _slices(backend, n=2, status="active")
    async with backend.unit_of_work() as uow:
        nodes = uow.repos.node_admin
        soon = await nodes.now() + timedelta(days=1)
        added = await nodes.add_waiver("n1", "parity", "ops", "vendor RMA", soon)
        await nodes.add_waiver("n1", "preflight", "ops", "second", soon)
        waivers = [_pick(w, "gate", "actor", "reason", "active") for w in await nodes.waivers("n1")]
        claims = [_pick(c, "allocation_id", "slot_id", "claim_kind", "status") for c in await nodes.live_claims("n1")]
        await uow.commit()
    assert _pick(added, "node_id", "gate", "actor", "reason", "expires_at") == (
        "n1",
        "parity",
        "ops",
        "vendor RMA",
        soon,
    )
    assert waivers == [("preflight", "ops", "second", True), ("parity", "ops", "vendor RMA", True)]
    assert claims == [(alloc, "n1-s0", "slot", "held"), (alloc, "n1-s1", "slot", "held")]


async def test_a_quota_is_set_read_and_the_tenants_live_gpus_counted(backend: Backend) -> None:
    await backend.add_node("n1")
    for i, status in enumerate(("active", "active")):
        await backend.add_slot(f"n1-s{i}", "n1", status)
    await backend.add_tenant_claim(uuid.uuid4(), "n1", "n1-s0", "acme", 2)
    await backend.add_tenant_claim(uuid.uuid4(), "n1", "n1-s1", "acme", 3)
    async with backend.unit_of_work() as uow:
        quotas = uow.repos.quotas
        assert await quotas.get("acme") is None
        await quotas.set("acme", 4, actor="ops", reason="trial")
        await quotas.set("acme", 8, actor="ops2", reason="paid")
        row = await quotas.get("acme")
        used, other = await quotas.gpus_in_use("acme"), await quotas.gpus_in_use("nobody")
        await uow.commit()
    assert _pick(row, "tenant_id", "max_gpus", "updated_by", "reason") == ("acme", 8, "ops2", "paid")
    assert (used, other) == (5, 0)


async def test_drift_is_listed_and_acknowledged_and_the_nodes_flag_follows(backend: Backend) -> None:
    await _slices(backend, n=1, status="available")
    slot = await backend.add_drift("n1", "n1-s0", "gpu0", "open")
    node = await backend.add_drift("n1", None, "nic", "open")
    gone = await backend.add_drift("n1", None, "old", "resolved")
    async with backend.unit_of_work() as uow:
        drift = uow.repos.drift_log
        assert await drift.node_flags("nope") is None
        before = _pick(await drift.node_flags("n1"), "drift_open", "drift_reported_at")
        current = [_pick(d, "drift_id", "slot_id", "status") for d in await drift.items("n1", include_resolved=False)]
        every = [d["drift_id"] for d in await drift.items("n1", include_resolved=True)]
        named = [d["drift_id"] for d in await drift.by_id("n1", [node, gone, 10_000])]
        acked = [_pick(d, "drift_id", "status", "acknowledged_by", "ack_reason") for d in
                 await drift.acknowledge("n1", [node], "ops", "known")]  # fmt: skip
        again = await drift.acknowledge("n1", [node], "ops", "known")
        after = _pick(await drift.node_flags("n1"), "drift_open")
        rest = [d["drift_id"] for d in await drift.acknowledge("n1", None, "ops", "all")]
        await uow.commit()
    assert before == (True, None)
    assert current == [(slot, "n1-s0", "open"), (node, None, "open")]
    assert (every, sorted(named)) == ([slot, node, gone], sorted([node, gone]))
    assert (acked, again, after, rest) == ([(node, "acknowledged", "ops", "known")], [], (False,), [slot])


async def test_a_site_wipe_policy_is_set_on_the_regions_slots_and_names_those_claimed(backend: Backend) -> None:
    alloc = await _slices(backend, n=2, status="active")
    await backend.add_slot("n1-s9", "n1", "available")
    async with backend.unit_of_work() as uow:
        policies = uow.repos.wipe_policies
        assert await policies.site("r") is None
        await policies.lock_region("r")
        changed = await policies.set_site("r", "nvme_format", actor="ops", reason="audit")
        claimed = await policies.claimed(changed)
        unchanged = await policies.set_site("r", "nvme_format", actor="ops", reason="again")
        site = _pick(await policies.site("r"), "region", "destructive_wipe_policy", "set_by", "reason")
        await uow.commit()
    assert (changed, claimed, unchanged) == (["n1-s0", "n1-s1", "n1-s9"], ["n1-s0", "n1-s1"], [])
    assert site == ("r", "nvme_format", "ops", "again")
    assert alloc is not None


async def test_a_force_release_loads_the_live_claims_and_saves_its_blocks_drains_and_end(backend: Backend) -> None:
    alloc = await _slices(backend, n=2, status="active")
    await backend.add_slot("n1-s2", "n1", "retired")
    await backend.add_claim(alloc, "n1", "n1-s2")
    whole = uuid.uuid4()
    await backend.add_node("bm1")
    await backend.add_claim(whole, "bm1", None)
    async with backend.unit_of_work() as uow:
        releases = uow.repos.force_releases
        assert await releases.get(uuid.uuid4()) is None
        release = await releases.get(alloc)
        assert release is not None and release.node_ids == ["n1"]
        assert [(c.slot_id, c.status) for c in release.claims] == [
            ("n1-s0", "active"),
            ("n1-s1", "active"),
            ("n1-s2", "retired"),
        ]
        release.release(actor="ops", reason="stuck", force=True)
        saved = await releases.save(release)
        assert await releases.get(alloc) is None and release.changes == []
        machine = await releases.get(whole)
        assert machine is not None and machine.claims == (HeldClaim("bm1", "node_exclusive"),)
        machine.release(actor="ops", reason="gone", force=True)
        drained = await releases.save(machine)
        await uow.commit()
    assert (saved.claims_ended, saved.slots_moved) == (3, ("n1-s0", "n1-s1"))
    assert (drained.claims_ended, drained.slots_moved) == (1, ())
    assert [await backend.slot_status(s) for s in ("n1-s0", "n1-s1", "n1-s2")] == [
        "cleanup_blocked",
        "cleanup_blocked",
        "retired",
    ]
    assert await backend.log(alloc) == [("n1-s0", "active", "cleanup_blocked"), ("n1-s1", "active", "cleanup_blocked")]
    assert await backend.drain_reason("bm1") == "force-released by ops: gone"
