"""The allocator's repository ports (gpuaas_allocator.service_layer.ports), one contract test each, run against the
handler tests' fake (tests/fakes/allocator.py) and the Postgres adapters alike: a fake that answers differently
from Postgres makes the handler tests prove a service that does not exist. Each backend is handed out by one
parametrised fixture (the eventsourcing library's one-test-per-backend pattern); the state a test reads is
arranged through the allocator's own handlers, as messages would."""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest

from gpuaas_allocator.adapters.repository import AllocationRepository
from gpuaas_allocator.domain.allocation import COLUMNS
from gpuaas_allocator.domain.model import ActiveImage
from gpuaas_allocator.service_layer.handlers import Allocator
from gpuaas_allocator.service_layer.ports import AllocatorUnitOfWork
from gpuaas_allocator.settings import AllocatorSettings
from gpuaas_common.bus import HandlerContext, deliver
from gpuaas_common.contract import Envelope
from gpuaas_common.contract import messages as m
from gpuaas_common.unit_of_work import FakeUnitOfWork, UnitOfWork
from tests.fakes.allocator import FakeAllocationRepository

from .allocator_db import HOST_IMAGE, IMAGE, pool  # noqa: F401 (fixture)

SLOT = m.SlotBinding(
    slot_id="n1-s0",
    gpu_pci_address="0000:18:00.0",
    nvme_by_id="nvme-x",
    fabric_vf_pci_address="0000:19:00.2",
    mac="52:54:00:00:00:01",
    private_ip="127.100.0.10",
    ovs_bridge="br-slice",
    profile="h200-slice",
)


@dataclass
class Backend:
    """One implementation of the ports: its units of work, and the allocator's handlers to arrange state with."""

    name: str
    unit_of_work: Callable[[], AllocatorUnitOfWork]
    allocator: Allocator

    async def send(self, handler: Callable[[Any], Awaitable[None]], type_: str, payload: m.Payload) -> None:
        env = Envelope.wrap(type_, payload.model_dump(mode="json"), producer="test", correlation_id="c")
        await deliver(handler, HandlerContext(env, payload, "s", "test", 1), self.unit_of_work())

    async def offering(self, *images: ActiveImage) -> None:
        async with self.unit_of_work() as uow:
            for image in images:
                await uow.repos.upsert_image(image)
            await uow.commit()

    async def requested(self, shape: str = "gpu_slice", tenant: str = "t") -> uuid.UUID:
        alloc, slice_ = uuid.uuid4(), shape == "gpu_slice"
        await self.send(
            self.allocator.on_requested,
            "allocation.requested",
            m.AllocationRequested(
                allocation_id=alloc,
                tenant_id=tenant,
                shape=shape,  # type: ignore[arg-type]
                sku="h200-sxm-slice" if slice_ else "h200-sxm",
                gpu_count=1 if slice_ else 8,
                image=IMAGE.slug if slice_ else HOST_IMAGE.slug,
                ssh_public_keys=["ssh-ed25519 AAAA k@t"],
            ),
        )
        return alloc

    async def placed(self, shape: str = "gpu_slice", node: str = "n1") -> uuid.UUID:
        """Provisioning: a slice's VM task out, or a host's MAAS deploy."""
        alloc, slice_ = await self.requested(shape), shape == "gpu_slice"
        await self.send(
            self.allocator.on_placed,
            "placement.placed",
            m.PlacementPlaced(
                allocation_id=alloc,
                node_id=node,
                claim_mode="slots" if slice_ else "node_exclusive",
                slots=[SLOT] if slice_ else [],
                maas_system_id=None if slice_ else "abc123",
                fencing_epoch=1,
            ),
        )
        return alloc

    async def deployed(self, node: str = "bm1") -> uuid.UUID:
        """A baremetal allocation whose machine MAAS deployed and whose host has not enrolled."""
        alloc = await self.placed("baremetal", node)
        row = await self.row(alloc)
        await self.send(
            self.allocator.on_maas_result,
            "maas.deploy_result",
            m.MaasDeployResult(
                operation_id=row["operation_id"],
                allocation_id=alloc,
                system_id="abc123",
                node_id=node,
                status="deployed",
                resolution="direct",
                attempts=1,
            ),
        )
        return alloc

    async def row(self, alloc: uuid.UUID) -> dict[str, Any]:
        async with self.unit_of_work() as uow:
            row = await uow.repos.lock(alloc)
        assert row is not None
        return row


@pytest.fixture(params=["fake", "postgres"])
def implementation(request: pytest.FixtureRequest) -> Backend:
    """Sync, so that it may ask for the Postgres pool (an async fixture) only where it is the one asked for."""
    allocator = Allocator(AllocatorSettings())
    if request.param == "fake":
        repo = FakeAllocationRepository()
        return Backend("fake", lambda: FakeUnitOfWork(repo, "allocator"), allocator)
    db = request.getfixturevalue("pool")
    return Backend("postgres", lambda: UnitOfWork(db, "allocator", "allocator", AllocationRepository), allocator)


@pytest.fixture
async def backend(implementation: Backend) -> Backend:
    """The implementation, knowing the two images the tests' requests name."""
    await implementation.offering(IMAGE, HOST_IMAGE)
    return implementation


# --- Allocations ------------------------------------------------------------------------------------------


async def test_an_allocation_is_locked_back_as_it_was_saved(backend: Backend) -> None:
    policy = backend.allocator.policy
    async with backend.unit_of_work() as uow:
        unknown = uuid.uuid4()
        assert await uow.repos.lock(unknown) is None
        assert await uow.repos.get(unknown, policy) is None
        assert await uow.repos.accepted_seq(unknown) is None
    alloc_id = await backend.placed()
    async with backend.unit_of_work() as uow:
        row = await uow.repos.lock(alloc_id)
        assert row is not None
        # Every column the aggregate reads is in the row: a missing one would be the dataclass's default instead.
        assert COLUMNS <= set(row), sorted(COLUMNS - set(row))
        assert (row["state"], row["tenant_id"], row["node_id"], row["awaiting_result"]) == (
            "provisioning",
            "t",
            "n1",
            True,
        )
        assert row["request"]["image"] == IMAGE.slug and row["placement"]["slots"][0]["slot_id"] == SLOT.slot_id
        alloc = await uow.repos.get(alloc_id, policy)
        assert alloc is not None and alloc.state == "provisioning"
        n = alloc.last_seq
        # `requested`, then `accepted` (seq 2), then the placement's entries.
        assert n > 2 and await uow.repos.accepted_seq(alloc_id) == 2
        alloc.note("checked", {"by": "it's -1 -- $1", "n": -1})
        alloc.fail("test_failure", "a reason", None, cleanup_required=False)
        await uow.repos.save(alloc)
        # Read in the unit of work that saved it: what the save wrote, the timeline numbered on.
        again = await uow.repos.get(alloc_id, policy)
        assert again is not None and (again.state, again.last_seq, again.failure_reason) == (
            "failed",
            n + 2,
            "a reason",
        )
        await uow.commit()
    async with backend.unit_of_work() as uow:
        row = await uow.repos.lock(alloc_id)
        assert row is not None
        alloc = uow.repos.aggregate(row, policy)
        assert (alloc.state, alloc.last_seq, alloc.failure_code) == ("failed", n + 2, "test_failure")
        assert await uow.repos.accepted_seq(alloc_id) == 2


async def test_the_machine_holders_are_the_baremetal_allocations_that_may_hold_the_machine(backend: Backend) -> None:
    held = await backend.placed("baremetal", "bm1")
    await backend.placed("gpu_slice", "bm1")  # a slice on the node: no machine of its tenant's
    await backend.requested("baremetal")  # not placed: no machine yet
    other = await backend.placed("baremetal", "bm2")
    async with backend.unit_of_work() as uow:
        assert [r["allocation_id"] for r in await uow.repos.lock_machine_holders("bm1")] == [held]
        assert [r["allocation_id"] for r in await uow.repos.lock_machine_holders("bm2")] == [other]
        assert await uow.repos.lock_machine_holders("bm3") == []


# --- DueAllocations ---------------------------------------------------------------------------------------


async def test_the_due_allocations_are_those_waiting_past_their_time(backend: Backend) -> None:
    accepted = await backend.requested()
    slice_ = await backend.placed("gpu_slice")
    deploying = await backend.placed("baremetal", "bm1")
    deployed = await backend.deployed("bm2")

    def ids(rows: list[dict[str, Any]]) -> set[uuid.UUID]:
        return {r["allocation_id"] for r in rows}

    # A negative wait makes every row that matches due now; a wait of an hour makes none of these due yet.
    past = -3600.0
    deadline_s = AllocatorSettings().task_deadline_s
    async with backend.unit_of_work() as uow:
        repos = uow.repos
        assert ids(await repos.lock_awaiting_placement(past, 10)) == {accepted}
        assert await repos.lock_awaiting_placement(3600, 10) == []
        assert ids(await repos.lock_overdue(-(deadline_s + 3600), 10)) == {slice_}
        assert await repos.lock_overdue(0, 10) == []
        assert ids(await repos.lock_awaiting_maas(past, 10)) == {deploying}
        assert await repos.lock_awaiting_maas(3600, 10) == []
        assert ids(await repos.lock_awaiting_enrolment(past, 10)) == {deployed}
        assert await repos.lock_awaiting_enrolment(3600, 10) == []
        # At most `limit`, the longest waiting first.
        second = await backend.requested()
        assert ids(await repos.lock_awaiting_placement(past, 1)) == {accepted}
        assert ids(await repos.lock_awaiting_placement(past, 10)) == {accepted, second}


# --- EarlyResults -----------------------------------------------------------------------------------------


async def test_an_early_result_is_kept_once_and_taken_once(backend: Backend) -> None:
    alloc = await backend.requested()
    result = {"status": "succeeded", "detail": {"vm": "it's", "n": [1, 2]}}
    async with backend.unit_of_work() as uow:
        await uow.repos.lock(alloc)
        assert await uow.repos.keep_early_result(alloc, "prov-x", "n1", result, "e1") is True
        assert await uow.repos.keep_early_result(alloc, "prov-x", "n2", {"other": 1}, "e2") is False
        await uow.commit()
    async with backend.unit_of_work() as uow:
        await uow.repos.lock(alloc)  # as `on_placed` does: the lock tells the repository one is kept
        assert await uow.repos.take_early_result(alloc, "prov-y") is None
        assert await uow.repos.take_early_result(alloc, "prov-x") == {"node_id": "n1", "result": result}
        assert await uow.repos.take_early_result(alloc, "prov-x") is None
        await uow.commit()
    async with backend.unit_of_work() as uow:
        await uow.repos.lock(alloc)
        assert await uow.repos.take_early_result(alloc, "prov-x") is None


# --- ImageCatalog -----------------------------------------------------------------------------------------


async def test_the_catalog_keeps_the_last_image_of_a_slug(backend: Backend) -> None:
    image = ActiveImage("ubuntu-new", "slice", "h200-sxm-slice", "c" * 64, "/img/new.raw", "cloud_init", "570")
    async with backend.unit_of_work() as uow:
        assert await uow.repos.get_image(image.slug) is None
        await uow.repos.upsert_image(image)
        assert await uow.repos.get_image(image.slug) == image
        newer = ActiveImage(image.slug, "slice", "h200-sxm-slice", "d" * 64, "/img/newer.raw")
        await uow.repos.upsert_image(newer)
        assert await uow.repos.get_image(image.slug) == newer
        await uow.repos.delete_image(image.slug)
        assert await uow.repos.get_image(image.slug) is None
        await uow.repos.delete_image(image.slug)  # deleting what is gone is no error
        assert await uow.repos.get_image(IMAGE.slug) == IMAGE
        await uow.commit()


async def test_an_image_clock_moves_forward_only_and_never_past_now(backend: Backend) -> None:
    slug, t0 = "ubuntu-slice", datetime.now(timezone.utc) - timedelta(hours=1)
    async with backend.unit_of_work() as uow:
        clock = uow.repos.advance_image_clock
        assert await clock(slug, t0) is True
        assert await clock(slug, t0) is False  # the same event again
        assert await clock(slug, t0 - timedelta(seconds=1)) is False
        assert await clock(slug, t0 + timedelta(seconds=1)) is True
        assert await clock("another-slug", t0 - timedelta(days=1)) is True  # each slug has its own
        await uow.commit()
    async with backend.unit_of_work() as uow:
        assert await uow.repos.advance_image_clock(slug, datetime.now(timezone.utc) + timedelta(days=1)) is True
        await uow.commit()
    # The future-dated event was kept as now: one dated after now, but long before its date, still applies.
    async with backend.unit_of_work() as uow:
        assert await uow.repos.advance_image_clock(slug, t0 + timedelta(seconds=2)) is False
        assert await uow.repos.advance_image_clock(slug, datetime.now(timezone.utc)) is True
        await uow.commit()


# --- TerminalSessions -------------------------------------------------------------------------------------


async def test_terminal_sessions_are_counted_live_until_ended_once(backend: Backend) -> None:
    first, second = await backend.placed(), await backend.requested()
    s1, s2 = uuid.uuid4(), uuid.uuid4()
    async with backend.unit_of_work() as uow:
        sessions = uow.repos.terminal
        assert await sessions.lock_allocation(uuid.uuid4()) is None
        assert await sessions.lock_allocation(first) == {
            "allocation_id": first,
            "tenant_id": "t",
            "shape": "gpu_slice",
            "state": "provisioning",
            "node_id": "n1",
        }
        await sessions.lock_tenant("t")
        assert await sessions.live_counts("t", first) == (0, 0)
        for session_id, alloc in ((s1, first), (s2, second)):
            await sessions.insert_session(
                session_id=session_id,
                allocation_id=alloc,
                tenant_id="t",
                actor="user:alice",
                node_id="n1",
                task_id=f"terminal-{session_id}",
                replica_id="r1",
            )
        assert await sessions.live_counts("t", first) == (1, 2)
        assert await sessions.live_counts("someone-else", first) == (0, 0)
        await uow.commit()
    async with backend.unit_of_work() as uow:
        sessions = uow.repos.terminal
        await sessions.renew_claims([s1, s2])
        assert await sessions.end_stale_sessions("t", 3600) == 0  # renewed lately: not stale
        assert await sessions.end_session(s1, reason="tenant_closed", bytes_to_guest=3, bytes_from_guest=5) is True
        assert await sessions.end_session(s1, reason="again", bytes_to_guest=0, bytes_from_guest=0) is False
        assert await sessions.end_session(uuid.uuid4(), reason="x", bytes_to_guest=0, bytes_from_guest=0) is False
        assert await sessions.live_counts("t", first) == (0, 1)
        # A claim older than a negative age: every live one is stale, and ended as its replica's.
        assert await sessions.end_stale_sessions("t", -60) == 1
        assert await sessions.live_counts("t", second) == (0, 0)
        assert await sessions.end_session(s2, reason="late", bytes_to_guest=0, bytes_from_guest=0) is False
        await uow.commit()
