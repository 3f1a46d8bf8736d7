"""Re-drive instead of ignore, on real Postgres with the allocator's and the scheduler's own handlers: every
message goes through the handler its consumer subscribes, in a unit of work as the bus runs it, and every event
either outbox holds is taken out, checked against the contract and handed on, as the relay and the bus would.

The scenario of the chaos run: the allocator's commit of `placed`/`provisioning` is lost (here: its unit of work
rolls back) after the provision task went out; the agent's success result arrives for a task the allocator has
no record of. The allocation must still become active, on the claim the scheduler holds."""

from __future__ import annotations

import uuid
from typing import Any

import asyncpg
import pytest

from gpuaas_allocator.adapters.repository import AllocationRepository
from gpuaas_allocator.domain.model import ActiveImage
from gpuaas_allocator.service_layer.commands import provision_task_id
from gpuaas_allocator.service_layer.deadlines import sweep_deadlines
from gpuaas_allocator.service_layer.handlers import Allocator
from gpuaas_allocator.service_layer.redrive import EARLY_TASK_RESULT
from gpuaas_allocator.settings import AllocatorSettings
from gpuaas_common.bus import HandlerContext, PermanentError, deliver, parse_message
from gpuaas_common.contract import Envelope
from gpuaas_common.contract import messages as m
from gpuaas_common.db import create_pool
from gpuaas_common.migrations import apply_migrations
from gpuaas_common.unit_of_work import UnitOfWork, no_repositories
from gpuaas_scheduler.adapters import synthetic
from gpuaas_scheduler.service_layer.handlers import Scheduler
from gpuaas_scheduler.service_layer.placement import PlacementPolicy

IMAGE = ActiveImage("ubuntu-slice", "slice", "h200-sxm-slice", "a" * 64, "/img/slice.raw")


class Plane:
    """The allocator and the scheduler over one database (a schema each), with the relay done by hand."""

    def __init__(self, alloc_pool: asyncpg.Pool, sched_pool: asyncpg.Pool, settings: AllocatorSettings) -> None:
        self.alloc_pool, self.sched_pool = alloc_pool, sched_pool
        self.settings = settings
        self.allocator = Allocator(settings)
        self.scheduler = Scheduler(PlacementPolicy())

    def alloc_uow(self) -> UnitOfWork[AllocationRepository]:
        return UnitOfWork(self.alloc_pool, "allocator", "allocator", AllocationRepository)

    async def to_allocator(self, handler: Any, env: Envelope, payload: Any) -> None:
        await deliver(handler, HandlerContext(env, payload, "s", "allocator-test", 1), self.alloc_uow())

    async def to_scheduler(self, env: Envelope, payload: Any) -> None:
        uow = UnitOfWork(self.sched_pool, "scheduler", "scheduler", no_repositories)
        await deliver(self.scheduler.on_accepted, HandlerContext(env, payload, "s", "scheduler-test", 1), uow)

    @staticmethod
    async def relay(pool: asyncpg.Pool) -> list[tuple[Envelope, Any]]:
        """Everything the service's outbox holds, in order, removed and validated against the contract."""
        rows = await pool.fetch("DELETE FROM outbox RETURNING id, subject, body")
        return [parse_message(r["subject"], bytes(r["body"])) for r in sorted(rows, key=lambda r: r["id"])]

    async def state(self, alloc: uuid.UUID) -> str:
        return await self.alloc_pool.fetchval("SELECT state FROM allocations WHERE allocation_id = $1", alloc)


def _of(events: list[tuple[Envelope, Any]], type_: str) -> list[tuple[Envelope, Any]]:
    return [(e, p) for e, p in events if e.type == type_]


@pytest.fixture
async def plane(fresh_db) -> Any:
    conn = await asyncpg.connect(fresh_db)
    await apply_migrations(conn, "allocator", "gpuaas_allocator.migrations")
    await apply_migrations(conn, "scheduler", "gpuaas_scheduler.migrations")
    await conn.execute("SET search_path = scheduler")
    await synthetic.build(conn, slice_hosts=2, slots_per_host=4, prefix=f"r{uuid.uuid4().hex[:4]}")
    await conn.close()
    alloc_pool = await create_pool(fresh_db, "allocator")
    sched_pool = await create_pool(fresh_db, "scheduler")
    p = Plane(alloc_pool, sched_pool, AllocatorSettings(placement_reask_after_s=30.0))
    async with p.alloc_uow() as uow:
        await uow.repos.upsert_image(IMAGE)
        await uow.commit()
    yield p
    await alloc_pool.close()
    await sched_pool.close()


async def _accepted(plane: Plane) -> tuple[uuid.UUID, Envelope, m.AllocationAccepted]:
    """A slice request accepted by the allocator; its placement request (allocation.accepted) taken from the outbox."""
    alloc = uuid.uuid4()
    req = m.AllocationRequested(
        allocation_id=alloc,
        tenant_id="t",
        shape="gpu_slice",
        sku="h200-sxm-slice",
        gpu_count=2,
        image=IMAGE.slug,
        ssh_public_keys=["ssh-ed25519 AAAA k@t"],
    )
    env = Envelope.wrap("allocation.requested", req.model_dump(mode="json"), producer="test", correlation_id="c")
    await plane.to_allocator(plane.allocator.on_requested, env, req)
    [(acc_env, acc)] = _of(await plane.relay(plane.alloc_pool), "allocation.accepted")
    return alloc, acc_env, acc


def _success(task: m.SliceVmProvision) -> tuple[Envelope, m.NodeTaskResult]:
    res = m.NodeTaskResult(
        task_id=task.task_id,
        allocation_id=task.allocation_id,
        node_id=task.node_id,
        task_type="slice.vm_provision",
        status="succeeded",
        readiness=m.Readiness(
            mac=task.slots[0].mac,
            expected_ip=task.slots[0].private_ip,
            actual_ip=task.slots[0].private_ip,
            lease_state="bound",
            ssh_ready=True,
        ),
    )
    return Envelope.wrap("node.task_result", res.model_dump(mode="json"), producer="agent", correlation_id="c"), res


async def test_a_result_for_a_task_whose_placement_commit_was_lost_is_re_driven_to_active(plane: Plane) -> None:
    alloc, acc_env, acc = await _accepted(plane)
    await plane.to_scheduler(acc_env, acc)
    [(placed_env, placed)] = _of(await plane.relay(plane.sched_pool), "placement.placed")

    # The allocator applies the placement and the outbox sends the task, then the commit is lost.
    uow = plane.alloc_uow()
    async with uow:
        await plane.allocator.on_placed(HandlerContext(placed_env, placed, "s", "allocator-test", 1, uow))
        # What the relay sent (validated as the agent's bus would) before the commit was lost.
        [(_, task)] = [
            parse_message(e.subject, e.envelope.model_dump_json().encode())
            for e in uow.events.pending
            if e.envelope.type == "slice.vm_provision"
        ]
        # leaving without commit: the rows of `placed` and `provisioning` never happened
    assert task.task_id == provision_task_id(AllocatorSettings(), alloc)
    assert await plane.state(alloc) == "accepted"

    # The agent built the VM and answers. The allocator has no record of the task: it keeps the result and re-asks.
    res_env, res = _success(task)
    await plane.to_allocator(plane.allocator.on_task_result, res_env, res)
    assert await plane.state(alloc) == "accepted"
    [(ask_env, ask)] = _of(await plane.relay(plane.alloc_pool), "allocation.accepted")
    assert ask_env.event_id != acc_env.event_id and ask.seq == acc.seq
    assert ask.model_dump(exclude={"seq"}) == acc.model_dump(exclude={"seq"})

    # The scheduler answers the repeated request with the claim it holds, not a second claim.
    await plane.to_scheduler(ask_env, ask)
    [(again_env, again)] = _of(await plane.relay(plane.sched_pool), "placement.placed")
    assert again_env.event_id != placed_env.event_id
    assert again.model_dump() == placed.model_dump()
    held = await plane.sched_pool.fetchval(
        "SELECT count(*) FROM allocation_resource_claims WHERE allocation_id = $1 AND status = 'held'", alloc
    )
    assert held == len(placed.slots) == 2

    # The placement is applied again; the kept result with it: the allocation converges to active.
    await plane.to_allocator(plane.allocator.on_placed, again_env, again)
    assert await plane.state(alloc) == "active"
    events = await plane.relay(plane.alloc_pool)
    assert [e.type for e, _ in events if e.type.startswith("allocation.")] == [
        "allocation.placed",
        "allocation.provisioning",
        "allocation.active",
    ]
    [(_, active)] = _of(events, "allocation.active")
    assert active.access.ip == task.slots[0].private_ip
    timeline = await plane.alloc_pool.fetch(
        "SELECT state, reason_code FROM allocation_timeline WHERE allocation_id = $1 ORDER BY seq", alloc
    )
    assert [(r["state"], r["reason_code"]) for r in timeline] == [
        ("requested", None),
        ("accepted", None),
        ("accepted", EARLY_TASK_RESULT),
        ("placed", None),
        ("provisioning", None),
        ("active", None),
    ]
    assert await plane.alloc_pool.fetchval("SELECT count(*) FROM early_task_results") == 0

    # A copy of the result now is a duplicate answer for a known task: nothing changes, nothing is dead-lettered.
    copy_env = Envelope.wrap("node.task_result", res.model_dump(mode="json"), producer="agent", correlation_id="c")
    await plane.to_allocator(plane.allocator.on_task_result, copy_env, res)
    assert await plane.state(alloc) == "active"


async def test_a_result_for_a_task_never_sent_to_anyone_is_still_dead_lettered(plane: Plane) -> None:
    alloc, _, _ = await _accepted(plane)
    res = m.NodeTaskResult(
        task_id="prov-somebody-else",
        allocation_id=alloc,
        node_id="r0000",
        task_type="slice.vm_provision",
        status="succeeded",
    )
    env = Envelope.wrap("node.task_result", res.model_dump(mode="json"), producer="agent", correlation_id="c")
    with pytest.raises(PermanentError) as err:
        await plane.to_allocator(plane.allocator.on_task_result, env, res)
    assert err.value.reason_code == "unknown_task"
    assert await plane.alloc_pool.fetchval("SELECT count(*) FROM early_task_results") == 0


async def test_a_placement_answer_that_never_came_is_asked_for_again_after_its_deadline(plane: Plane) -> None:
    alloc, acc_env, acc = await _accepted(plane)
    # The scheduler placed it, but its answer was lost with the allocator's side of the exchange.
    await plane.to_scheduler(acc_env, acc)
    [(_, placed)] = _of(await plane.relay(plane.sched_pool), "placement.placed")

    await sweep_deadlines(plane.alloc_uow, plane.settings)
    assert await plane.relay(plane.alloc_pool) == []  # not overdue yet: nothing asked
    await plane.alloc_pool.execute(
        "UPDATE allocations SET updated_at = now() - interval '31 seconds' WHERE allocation_id = $1", alloc
    )
    await sweep_deadlines(plane.alloc_uow, plane.settings)
    [(ask_env, ask)] = _of(await plane.relay(plane.alloc_pool), "allocation.accepted")
    assert (
        await plane.alloc_pool.fetchval("SELECT placement_asks FROM allocations WHERE allocation_id = $1", alloc) == 1
    )
    await sweep_deadlines(plane.alloc_uow, plane.settings)
    assert await plane.relay(plane.alloc_pool) == []  # the ask restarted the wait

    await plane.to_scheduler(ask_env, ask)
    [(again_env, again)] = _of(await plane.relay(plane.sched_pool), "placement.placed")
    assert again.model_dump() == placed.model_dump()
    await plane.to_allocator(plane.allocator.on_placed, again_env, again)
    assert await plane.state(alloc) == "provisioning"
    events = await plane.relay(plane.alloc_pool)
    [(_, task)] = _of(events, "slice.vm_provision")
    assert task.fencing_epoch == placed.fencing_epoch and task.node_id == placed.node_id


async def test_a_placement_made_again_after_the_schedulers_commit_was_lost_is_a_new_message(plane: Plane) -> None:
    """The scheduler placed and its answer went out, then its commit was lost (claim and inbox row gone); the
    allocator lost its side too and asks again. The scheduler places afresh: that answer must not carry the
    first one's id, or JetStream drops it as a duplicate and the allocation waits for another re-ask."""
    alloc, acc_env, acc = await _accepted(plane)
    uow = UnitOfWork(plane.sched_pool, "scheduler", "scheduler", no_repositories)
    async with uow:
        await plane.scheduler.on_accepted(HandlerContext(acc_env, acc, "s", "scheduler-test", 1, uow))
        [first] = [e.envelope for e in uow.events.pending if e.envelope.type == "placement.placed"]
        # leaving without commit: the claim and the outbox row never happened
    assert await plane.sched_pool.fetchval("SELECT count(*) FROM allocation_resource_claims") == 0

    await plane.alloc_pool.execute(
        "UPDATE allocations SET updated_at = now() - interval '31 seconds' WHERE allocation_id = $1", alloc
    )
    await sweep_deadlines(plane.alloc_uow, plane.settings)
    [(ask_env, ask)] = _of(await plane.relay(plane.alloc_pool), "allocation.accepted")
    await plane.to_scheduler(ask_env, ask)
    [(again_env, again)] = _of(await plane.relay(plane.sched_pool), "placement.placed")
    assert again_env.event_id != first.event_id
    await plane.to_allocator(plane.allocator.on_placed, again_env, again)
    assert await plane.state(alloc) == "provisioning"
