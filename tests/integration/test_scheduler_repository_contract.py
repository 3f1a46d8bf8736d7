"""The scheduler's claims and slots repositories (adapters/repository.py: ClaimRepository, SlotRepository), one
contract test each, run against the handler tests' fakes (tests/fakes/scheduler.py) and Postgres alike, through
one parametrised fixture, as the allocator's are (test_allocator_repository_contract.py). The scheduler's rows
are arranged by each backend's own hands (a node, its slots, an allocation's claims), since placement, which
writes them in production, is no repository's; what is read back goes through the repositories."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import asyncpg
import pytest

from gpuaas_common.unit_of_work import FakeUnitOfWork, UnitOfWork
from gpuaas_scheduler.adapters.repository import scheduler_repositories
from gpuaas_scheduler.domain.node_claims import HeldClaim, NodeDrained, SlotsMoved
from tests.fakes.scheduler import Claim, FakeClaims, FakeNodes, FakeRepositories, FakeSlots, Slot, World

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


def _disk(slot_id: str) -> str:
    return f"/dev/disk/by-id/nvme-{slot_id}"


def _fake() -> Backend:
    world = World()
    repos = FakeRepositories(FakeNodes(world), FakeSlots(world), FakeClaims(world))

    async def add_node(node: str) -> None:
        world.nodes.add(node)

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

    return Backend(
        "fake",
        lambda: FakeUnitOfWork(repos, "scheduler"),
        add_node,
        add_slot,
        add_claim,
        slot_status,
        log,
        drain_reason,
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

    return Backend(
        "postgres",
        lambda: UnitOfWork(pool, "scheduler", "scheduler", scheduler_repositories),
        add_node,
        add_slot,
        add_claim,
        slot_status,
        log,
        drain_reason,
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
