"""The scheduler's claim audit on real Postgres (issue 13, deliverable 7: "claims held for allocations the
allocator does not know … are reported and resolved"). The scheduler lost its handling of an allocation's end
(a Postgres that drops acknowledged commits): the audit asks the owner and settles the claims — slots into
cleanup_blocked (no wipe proof reached it), a machine held whole drained unless its release is confirmed — and
leaves alone what the owner still runs, what is too young to judge and what it could not ask about. Replicas
auditing at once ask about each allocation once and free each claim once. The allocator side of the question
is tested across the bus in test_cli_allocator_answers.py."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Sequence
from datetime import datetime, timedelta, timezone

import pytest

from gpuaas_common.bus import HandlerContext, deliver, parse_message
from gpuaas_common.contract import Envelope
from gpuaas_common.contract import messages as m
from gpuaas_common.unit_of_work import UnitOfWork, no_repositories
from gpuaas_scheduler.adapters import inventory as inv
from gpuaas_scheduler.adapters import synthetic
from gpuaas_scheduler.service_layer.claim_audit import AuditPolicy, audit_claims
from gpuaas_scheduler.service_layer.handlers import Scheduler

from .scheduler_db import accepted, run_place, scheduler_pool

POLICY = AuditPolicy(every_s=300.0, min_age_s=60.0, orphan_after_s=600.0)


@pytest.fixture
async def pool(fresh_db):
    async with scheduler_pool(fresh_db) as p:
        async with p.acquire() as conn:
            await synthetic.build(conn, slice_hosts=1, slots_per_host=4, baremetal_hosts=2)
        yield p


class Owner:
    """The allocator as the audit meets it: what it says of each allocation, and every question asked."""

    def __init__(self, meet: asyncio.Barrier | None = None) -> None:
        self.says: dict[uuid.UUID, tuple[str, str | None, float]] = {}  # id -> (state, node, seconds since change)
        self.asked: list[uuid.UUID] = []
        self.answering = True
        # Replicas: the first answer waits until every replica has taken a batch and asked, so their rounds
        # overlap for certain (each holds stamped claims while the others take theirs).
        self.meet = meet

    async def ask(self, ids: Sequence[uuid.UUID]) -> dict[uuid.UUID, m.AllocationSummary] | None:
        self.asked += ids
        if self.meet is not None:
            meet, self.meet = self.meet, None
            await meet.wait()
        if not self.answering:
            return None
        now = datetime.now(timezone.utc)
        return {
            i: m.AllocationSummary(
                allocation_id=i,
                tenant_id="t1",
                shape="gpu_slice",
                sku="h200-sxm-slice",
                gpu_count=1,
                region="default",
                image="img",
                state=state,
                node_id=node,
                created_at=now - timedelta(hours=1),
                updated_at=now - timedelta(seconds=age),
            )
            for i, (state, node, age) in self.says.items()
            if i in ids
        }


def uow(pool):
    return UnitOfWork(pool, "scheduler", "scheduler", no_repositories)


async def audit(pool, owner: Owner, policy: AuditPolicy = POLICY):
    return await audit_claims(lambda: uow(pool), owner.ask, policy)


async def placed(pool, *, status: str = "active", shape: str = "gpu_slice", age_s: float = 3600.0) -> m.PlacementPlaced:
    """A placement whose claims are `age_s` old, its slots walked to `status` as the lifecycle events would."""
    ev = accepted(8, shape, sku="h200-sxm") if shape == "baremetal" else accepted(1)
    p = (await run_place(pool, ev)).placed
    assert p is not None
    async with pool.acquire() as conn, conn.transaction():
        walk = {"reserved": [], "provisioning": ["provisioning"], "active": ["provisioning", "active"]}[status]
        for to in walk:
            await inv.set_slot_status(conn, p.allocation_id, to)
        await conn.execute(
            "UPDATE allocation_resource_claims SET created_at = clock_timestamp() - make_interval(secs => $2) "
            "WHERE allocation_id = $1",
            p.allocation_id,
            age_s,
        )
    return p


async def live_claims(pool, alloc: uuid.UUID) -> int:
    return await pool.fetchval(
        "SELECT count(*) FROM allocation_resource_claims WHERE allocation_id = $1 AND status <> 'released'", alloc
    )


async def test_claims_of_an_allocation_the_allocator_ended_go_to_cleanup_blocked_and_the_rest_stay(pool) -> None:
    ended, running = await placed(pool), await placed(pool)
    owner = Owner()
    owner.says = {
        ended.allocation_id: ("released", ended.node_id, 120.0),
        running.allocation_id: ("active", running.node_id, 900.0),
    }

    first = await audit(pool, owner)

    assert first.released == [str(ended.allocation_id)] and first.asked == 2 and not first.unanswered
    assert sorted(owner.asked) == sorted([ended.allocation_id, running.allocation_id])  # one question, both ids
    assert await live_claims(pool, ended.allocation_id) == 0
    assert await live_claims(pool, running.allocation_id) == 1
    slot = await pool.fetchrow(
        "SELECT status, status_reason, health_state FROM node_resource_slots WHERE slot_id = $1",
        ended.slots[0].slot_id,
    )
    assert (slot["status"], slot["health_state"]) == ("cleanup_blocked", "failed")
    assert slot["status_reason"].startswith("claim audit: the allocator says released")
    moved = await pool.fetchrow(
        "SELECT from_status, actor FROM slot_transitions WHERE slot_id = $1 ORDER BY id DESC LIMIT 1",
        ended.slots[0].slot_id,
    )
    assert (moved["from_status"], moved["actor"]) == ("active", "claim-audit")
    assert await pool.fetchval("SELECT free_slots FROM nodes WHERE node_id = $1", ended.node_id) == 2

    # Audited a moment ago, the running one is not asked about again before `every_s`.
    owner.asked.clear()
    again = await audit(pool, owner)
    assert (again.asked, owner.asked) == (0, [])


async def test_an_end_the_scheduler_may_still_receive_and_claims_too_young_to_judge_are_left_alone(pool) -> None:
    recent_end, young = await placed(pool), await placed(pool, age_s=5.0)
    owner = Owner()
    owner.says = {
        recent_end.allocation_id: ("released", recent_end.node_id, 5.0),
        young.allocation_id: ("failed", None, 900.0),
    }

    result = await audit(pool, owner)

    assert result.released == [] and owner.asked == [recent_end.allocation_id]
    assert await live_claims(pool, recent_end.allocation_id) == 1 and await live_claims(pool, young.allocation_id) == 1


async def test_claims_the_allocator_never_heard_of_are_released_only_once_they_are_old(pool) -> None:
    old, recent = (
        await placed(pool, status="reserved", age_s=3600.0),
        await placed(pool, status="reserved", age_s=120.0),
    )
    result = await audit(pool, Owner())
    assert result.released == [str(old.allocation_id)]
    assert await live_claims(pool, old.allocation_id) == 0 and await live_claims(pool, recent.allocation_id) == 1
    status = await pool.fetchval("SELECT status FROM node_resource_slots WHERE slot_id = $1", old.slots[0].slot_id)
    assert status == "cleanup_blocked"  # reserved by our record, but a lost commit may hide a provision
    # The settlement announced the host's slots, the blocked one failed (scheduler.slots_changed).
    rows = await pool.fetch("DELETE FROM outbox RETURNING subject, body")
    [(env, change)] = [parse_message(r["subject"], bytes(r["body"])) for r in rows]
    assert (env.type, change.cause, change.actor) == ("scheduler.slots_changed", "claim_audit", "claim-audit")
    blocked = {s.slot_id: (s.status, s.health_state) for s in change.slots}[old.slots[0].slot_id]
    assert blocked == ("cleanup_blocked", "failed")

    # The allocation comes back (its portal asked again): the scheduler answers that its claims are gone,
    # so it ends unschedulable instead of waiting for a placement for good.
    ev = accepted(1).model_copy(update={"allocation_id": old.allocation_id})
    env = Envelope.wrap("allocation.accepted", ev.model_dump(mode="json"), producer="allocator", correlation_id="c")
    await deliver(Scheduler().on_accepted, HandlerContext(env, ev, "s", "scheduler-test", 1), uow(pool))
    rows = await pool.fetch("DELETE FROM outbox RETURNING subject, body")
    answers = [parse_message(r["subject"], bytes(r["body"])) for r in rows]
    assert [(e.type, p.reason_code) for e, p in answers] == [("placement.unschedulable", "claims_released")]


async def test_a_machine_held_whole_is_drained_unless_the_allocator_says_it_was_released(pool) -> None:
    failed, released = await placed(pool, shape="baremetal"), await placed(pool, shape="baremetal")
    owner = Owner()
    owner.says = {
        failed.allocation_id: ("failed", failed.node_id, 300.0),
        released.allocation_id: ("released", released.node_id, 300.0),
    }

    result = await audit(pool, owner)

    assert sorted(result.released) == sorted([str(failed.allocation_id), str(released.allocation_id)])
    rows = {
        r["node_id"]: r
        for r in await pool.fetch("SELECT node_id, draining, drain_reason FROM nodes WHERE node_id LIKE 'bm%'")
    }
    assert rows[failed.node_id]["draining"] and "the allocator says failed" in rows[failed.node_id]["drain_reason"]
    assert not rows[released.node_id]["draining"]
    assert await live_claims(pool, failed.allocation_id) == await live_claims(pool, released.allocation_id) == 0


async def test_no_answer_settles_nothing_and_a_disagreement_on_the_node_is_only_reported(pool) -> None:
    lost, elsewhere = await placed(pool), await placed(pool)
    owner = Owner()
    owner.answering = False
    owner.says = {lost.allocation_id: ("released", lost.node_id, 900.0)}
    assert (await audit(pool, owner)).unanswered
    assert await live_claims(pool, lost.allocation_id) == 1

    owner.answering = True
    owner.says[elsewhere.allocation_id] = ("active", "some-other-node", 900.0)
    # `every_s` later (a round a millisecond later, as once written here, found nothing due on a quiet machine).
    await pool.execute("UPDATE allocation_resource_claims SET audited_at = audited_at - interval '1 hour'")
    result = await audit(pool, owner)
    assert result.released == [str(lost.allocation_id)] and result.reported == [str(elsewhere.allocation_id)]
    assert await live_claims(pool, elsewhere.allocation_id) == 1


async def test_replicas_auditing_at_once_ask_about_each_allocation_once_and_free_each_claim_once(pool) -> None:
    allocations = [await placed(pool) for _ in range(4)]
    meet = asyncio.Barrier(2)
    owners = [Owner(meet), Owner(meet)]
    for owner in owners:
        owner.says = {p.allocation_id: ("released", p.node_id, 300.0) for p in allocations}
    one_claim_each = AuditPolicy(every_s=300.0, min_age_s=60.0, orphan_after_s=600.0, batch=1)

    rounds = await asyncio.gather(*(audit(pool, o, one_claim_each) for o in owners))

    assert owners[0].asked and owners[1].asked  # both replicas audited
    asked = owners[0].asked + owners[1].asked
    assert sorted(asked) == sorted(p.allocation_id for p in allocations)  # each once, by one replica or the other
    freed = rounds[0].released + rounds[1].released
    assert sorted(freed) == sorted(str(p.allocation_id) for p in allocations)
    assert [await live_claims(pool, p.allocation_id) for p in allocations] == [0, 0, 0, 0]
