"""The scheduler's lifecycle handlers with an in-memory unit of work: how an allocation's slots follow it and
how its end frees or blocks them (the NodeClaims aggregate), without servers, as the allocator's handlers are
tested (test_allocator_handlers.py)."""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from gpuaas_common.bus import HandlerContext, deliver
from gpuaas_common.contract import Envelope
from gpuaas_common.contract import messages as m
from gpuaas_common.unit_of_work import FakeUnitOfWork
from gpuaas_scheduler.service_layer.handlers import (
    ArrivedEarly,
    EndedOutOfOrder,
    Scheduler,
    allocation_first_lock,
    mirrored,
)
from tests.fakes.scheduler import Claim, FakeClaims, FakeNodes, FakeRepositories, FakeSlots, Slot, World

CONSUMER = "scheduler-allocation-events"


def blkdiscard(device: str, **kw: Any) -> m.WipeProof:
    return m.WipeProof(device=device, method=kw.pop("method", "blkdiscard"), verified=kw.pop("verified", True), **kw)


class Harness:
    def __init__(self) -> None:
        self.world = World()
        self.repos = FakeRepositories(FakeNodes(self.world), FakeSlots(self.world), FakeClaims(self.world))
        self.inbox: set[tuple[str, str]] = set()
        self.scheduler = Scheduler()
        self.last: FakeUnitOfWork | None = None

    def placed(self, node: str = "n1", gpus: int = 2, status: str = "reserved") -> uuid.UUID:
        """An allocation holding `gpus` slots of `node` (as placement leaves them: reserved, claimed)."""
        alloc = uuid.uuid4()
        self.world.nodes.add(node)
        for _ in range(gpus):
            slot_id = f"{node}-s{len(self.world.slots)}"
            self.world.slots[slot_id] = Slot(slot_id, node, status, f"/dev/disk/by-id/nvme-{slot_id}")
            self.world.claims.append(Claim(alloc, node, slot_id))
        return alloc

    def whole(self, node: str = "bm1") -> uuid.UUID:
        alloc = uuid.uuid4()
        self.world.nodes.add(node)
        self.world.claims.append(Claim(alloc, node, None))
        return alloc

    def status(self, alloc: uuid.UUID) -> list[str]:
        return [self.world.slots[c.slot_id].status for c in self.world.claims if c.allocation_id == alloc and c.slot_id]

    def devices(self, alloc: uuid.UUID) -> list[str]:
        return [
            self.world.slots[c.slot_id].nvme_by_id for c in self.world.claims if c.allocation_id == alloc and c.slot_id
        ]

    def live(self, alloc: uuid.UUID) -> int:
        return len(self.world.live(alloc))

    async def send(self, type_: str, payload: m.AllocationEvent, envelope: Envelope | None = None) -> bool:
        env = envelope or Envelope.wrap(
            type_, payload.model_dump(mode="json"), producer="allocator", correlation_id=str(payload.allocation_id)
        )
        handler = {
            "allocation.provisioning": self.scheduler.on_provisioning,
            "allocation.active": self.scheduler.on_active,
            "allocation.released": self.scheduler.on_released,
            "allocation.failed": self.scheduler.on_failed,
        }[type_]
        self.last = FakeUnitOfWork(self.repos, "scheduler", seen=self.inbox)
        ctx = HandlerContext(env, payload, f"gpuaas.allocation.event.{type_.split('.')[1]}", CONSUMER, 1)
        return await deliver(handler, ctx, self.last, first_lock=allocation_first_lock(payload))


def _event(cls: type, alloc: uuid.UUID, state: str, **kw: Any) -> Any:
    return cls(allocation_id=alloc, tenant_id="t1", shape=kw.pop("shape", "gpu_slice"), state=state, seq=5, **kw)


def provisioning(alloc):
    return _event(m.AllocationProvisioning, alloc, "provisioning", node_id="n1")


def active(alloc):
    return _event(m.AllocationActive, alloc, "active", node_id="n1", access=m.AccessInfo())


def released(alloc, *proofs: m.WipeProof, required: bool = True, reason: str | None = None):
    cleanup = m.CleanupReport(required=required, verified=bool(proofs), wipe_proofs=list(proofs), reason=reason)
    return _event(m.AllocationReleased, alloc, "released", cleanup=cleanup)


def failed(alloc, *proofs: m.WipeProof, required: bool = True, shape: str = "gpu_slice"):
    return _event(
        m.AllocationFailed,
        alloc,
        "failed",
        shape=shape,
        reason_code="task_failed",
        reason="host said no",
        cleanup_required=required,
        wipe_proofs=list(proofs),
    )


@pytest.fixture
def h() -> Harness:
    return Harness()


async def _run_to_active(h: Harness, alloc: uuid.UUID) -> None:
    for type_, ev in (("allocation.provisioning", provisioning(alloc)), ("allocation.active", active(alloc))):
        assert await h.send(type_, ev)


async def test_the_slots_follow_the_allocation_and_a_verified_wipe_frees_them(h: Harness) -> None:
    alloc = h.placed()
    await _run_to_active(h, alloc)
    assert h.status(alloc) == ["active", "active"]
    assert await h.send("allocation.released", released(alloc, *(blkdiscard(d) for d in h.devices(alloc))))
    assert h.last is not None and h.last.committed
    assert h.status(alloc) == ["available", "available"]
    assert h.live(alloc) == 0
    # Every move logged under the allocation, through cleanup; the summary of the node recomputed.
    moves = [(to, a) for s, _f, to, a, _d in h.world.log if s == "n1-s0"]
    assert moves == [(s, alloc) for s in ("provisioning", "active", "cleanup", "available")]
    assert h.world.refreshed[-1] == ["n1"]


async def test_a_proof_the_slots_policy_refuses_blocks_that_slot_alone(h: Harness) -> None:
    alloc = h.placed()
    await _run_to_active(h, alloc)
    good, bad = h.devices(alloc)
    assert await h.send("allocation.released", released(alloc, blkdiscard(good), blkdiscard(bad, method="nvme_format")))
    assert h.status(alloc) == ["available", "cleanup_blocked"]
    assert h.world.slots["n1-s1"].health == "failed"
    assert h.live(alloc) == 0  # a blocked slot is kept out by its status, not by a claim


async def test_released_before_provisioning_returns_slots_the_log_never_saw_provisioned(h: Harness) -> None:
    alloc = h.placed()
    assert await h.send("allocation.released", released(alloc, required=False, reason="cancelled"))
    assert h.status(alloc) == ["available", "available"]
    # The host's word against the log: a provisioned slot waits for a wipe.
    other = h.placed()
    assert await h.send("allocation.provisioning", provisioning(other))
    assert await h.send("allocation.released", released(other, required=False))
    assert h.status(other) == ["cleanup_blocked", "cleanup_blocked"]


async def test_a_failed_attempt_frees_its_slots_only_when_every_disk_is_proven_wiped(h: Harness) -> None:
    alloc = h.placed()
    assert await h.send("allocation.provisioning", provisioning(alloc))
    first, _second = h.devices(alloc)
    assert await h.send("allocation.failed", failed(alloc, blkdiscard(first)))
    assert h.status(alloc) == ["cleanup_blocked", "cleanup_blocked"]
    reasons = [d for s, _f, to, _a, d in h.world.log if to == "cleanup_blocked"]
    assert len(reasons) == 2 and h.live(alloc) == 0
    both = h.placed()
    assert await h.send("allocation.provisioning", provisioning(both))
    assert await h.send("allocation.failed", failed(both, *(blkdiscard(d) for d in h.devices(both))))
    assert h.status(both) == ["available", "available"]


async def test_a_failure_that_never_wrote_returns_the_slots_unless_they_ran(h: Harness) -> None:
    alloc = h.placed()
    assert await h.send("allocation.provisioning", provisioning(alloc))
    assert await h.send("allocation.failed", failed(alloc, required=False))
    assert h.status(alloc) == ["available", "available"]


async def test_a_whole_host_failed_with_cleanup_is_drained(h: Harness) -> None:
    alloc = h.whole("bm1")
    assert await h.send("allocation.failed", failed(alloc, shape="baremetal"))
    assert h.world.drained == {"bm1": "cleanup required after task_failed: host said no"}
    assert h.live(alloc) == 0


async def test_an_end_that_says_nothing_was_written_blocks_slots_the_log_shows_running(h: Harness) -> None:
    alloc = h.placed()
    assert await h.send("allocation.provisioning", provisioning(alloc))
    assert await h.send("allocation.active", active(alloc))
    # No `releasing` in between (the scheduler does not follow it): the log is what contradicts the host's word.
    assert await h.send("allocation.released", released(alloc, required=False))
    assert h.status(alloc) == ["cleanup_blocked", "cleanup_blocked"] and h.live(alloc) == 0


async def test_an_end_the_slots_status_and_log_disagree_on_changes_nothing_and_is_retried(h: Harness) -> None:
    alloc = h.placed()
    for claim in h.world.claims:
        if claim.allocation_id == alloc and claim.slot_id:
            h.world.slots[claim.slot_id].status = "active"  # active, yet the log never saw it provisioned
    with pytest.raises(EndedOutOfOrder):
        await h.send("allocation.released", released(alloc, required=False))
    assert h.last is not None and not h.last.committed
    assert h.status(alloc) == ["active", "active"] and h.live(alloc) == 2


async def test_active_before_its_provisioning_waits_for_it(h: Harness) -> None:
    alloc = h.placed()
    with pytest.raises(ArrivedEarly):
        await h.send("allocation.active", active(alloc))
    assert h.status(alloc) == ["reserved", "reserved"]
    assert await h.send("allocation.provisioning", provisioning(alloc))
    assert await h.send("allocation.active", active(alloc))
    assert h.status(alloc) == ["active", "active"]


async def test_a_redelivered_end_is_a_no_op(h: Harness) -> None:
    alloc = h.placed()
    await _run_to_active(h, alloc)
    ev = released(alloc, *(blkdiscard(d) for d in h.devices(alloc)))
    env = Envelope.wrap("allocation.released", ev.model_dump(mode="json"), producer="allocator", correlation_id="c")
    assert await h.send("allocation.released", ev, env)
    log = len(h.world.log)
    assert not await h.send("allocation.released", ev, env)
    assert len(h.world.log) == log
    # The handlers took no lock of their own: the bus took the allocation's with the BEGIN.
    assert h.repos.claims.locked == []


@pytest.mark.parametrize(
    ("event", "shape", "wanted"),
    [
        (provisioning, "gpu_slice", True),
        (active, "gpu_slice", True),
        (provisioning, "baremetal", False),  # a node claim has no slot to move
        (active, "baremetal", False),
        (released, "baremetal", True),  # its end still frees the node
        (failed, "baremetal", True),
    ],
)
def test_the_mirror_reads_only_what_moves_a_slot(event: Any, shape: str, wanted: bool) -> None:
    payload = event(uuid.uuid4()).model_copy(update={"shape": shape})
    assert mirrored(payload) is wanted


# --- a host's slots announced when an end leaves one cleanup_blocked (scheduler.slots_changed) ------------


def announced(h: Harness) -> list[dict[str, Any]]:
    """The slots_changed events the last message's unit of work committed, each read back through the contract."""
    assert h.last is not None and h.last.committed
    return [
        m.SlotsChanged.model_validate(e.payload).model_dump(mode="json")
        for e in h.last.published
        if e.type == "scheduler.slots_changed"
    ]


async def test_an_end_that_gives_every_slot_back_healthy_announces_nothing(h: Harness) -> None:
    alloc = h.placed()
    await _run_to_active(h, alloc)
    assert announced(h) == []
    assert await h.send("allocation.released", released(alloc, *(blkdiscard(d) for d in h.devices(alloc))))
    assert announced(h) == []
    untouched = h.placed()
    assert await h.send("allocation.released", released(untouched, required=False, reason="cancelled"))
    assert announced(h) == []
    never_wrote = h.placed()
    assert await h.send("allocation.provisioning", provisioning(never_wrote))
    assert await h.send("allocation.failed", failed(never_wrote, required=False))
    assert announced(h) == [] and h.world.announced == {}


async def test_a_refused_wipe_proof_announces_the_hosts_slots_with_the_blocked_ones_health(h: Harness) -> None:
    alloc = h.placed()
    await _run_to_active(h, alloc)
    good, bad = h.devices(alloc)
    assert await h.send("allocation.released", released(alloc, blkdiscard(good), blkdiscard(bad, method="nvme_format")))
    [change] = announced(h)
    assert (change["node_id"], change["generation"], change["cause"], change["actor"]) == (
        "n1",
        1,
        "release",
        "scheduler",
    )
    slots = {s["slot_id"]: s for s in change["slots"]}
    assert {k: (s["status"], s["health_state"]) for k, s in slots.items()} == {
        "n1-s0": ("available", "healthy"),
        "n1-s1": ("cleanup_blocked", "failed"),
    }
    assert slots["n1-s1"]["status_reason"] and slots["n1-s1"]["status_reason"] == slots["n1-s1"]["health_detail"]


async def test_a_failure_without_proof_announces_every_slot_blocked_and_numbers_the_hosts_announcements(
    h: Harness,
) -> None:
    first = h.placed()
    assert await h.send("allocation.provisioning", provisioning(first))
    assert await h.send("allocation.failed", failed(first))
    [one] = announced(h)
    second = h.placed()  # two more slots of the same host
    assert await h.send("allocation.provisioning", provisioning(second))
    assert await h.send("allocation.failed", failed(second))
    [two] = announced(h)
    assert (one["cause"], two["cause"]) == ("failure", "failure")
    assert (one["generation"], two["generation"]) == (1, 2)
    # Each carries every slot of the host as it is then: the later one the four.
    assert len(one["slots"]) == 2 and len(two["slots"]) == 4
    assert {s["status"] for s in two["slots"]} == {"cleanup_blocked"}


async def test_a_whole_host_failure_blocks_no_slot_and_announces_nothing(h: Harness) -> None:
    alloc = h.whole("bm1")
    assert await h.send("allocation.failed", failed(alloc, shape="baremetal"))
    assert announced(h) == []


async def test_a_redelivered_end_announces_nothing_again(h: Harness) -> None:
    """The announcement is raised in the end's unit of work: its redelivery, a no-op by the inbox, raises none."""
    alloc = h.placed()
    assert await h.send("allocation.provisioning", provisioning(alloc))
    ev = failed(alloc)
    env = Envelope.wrap("allocation.failed", ev.model_dump(mode="json"), producer="allocator", correlation_id="c")
    assert await h.send("allocation.failed", ev, env)
    assert len(announced(h)) == 1
    assert not await h.send("allocation.failed", ev, env)  # the redelivery: a no-op, nothing raised
    assert h.last is not None and h.last.published == []
