"""The walk of a converting host back to slice mode (domain/host_walk.py): every event in every state as a table,
and the walk's handlers with the in-memory unit of work the scheduler's handler tests use, as the messages that
drive it arrive (deploy result, topology and parity reports) and the commands it sends come out."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import pytest

from gpuaas_common.bus import HandlerContext, deliver
from gpuaas_common.contract import Envelope
from gpuaas_common.contract import messages as m
from gpuaas_common.unit_of_work import FakeUnitOfWork
from gpuaas_scheduler.domain.host_walk import (
    DEPLOYED,
    PARITY_PASSED,
    REAPPROVED,
    REDEPLOY_REQUESTED,
    REDISCOVERED,
    STATES,
    STOPPED,
    ApprovedSlot,
    AskRediscovery,
    HostWalk,
    Reapprove,
    RequestDeploy,
    WalkError,
    match_candidates,
)
from gpuaas_scheduler.service_layer.host_walk import HostWalker, WalkPolicy, carry_out, operation_id_of

AT = datetime(2026, 11, 27, tzinfo=UTC)
SLOTS = (ApprovedSlot("h1-s0", "0000:17:00.0", "h200_1g_24c_64g_plain"), ApprovedSlot("h1-s1", "0000:3d:00.0"))
ACT = "rediscover-1"
WALK = str(uuid.UUID(int=7))


def started(walk_id: str = WALK) -> HostWalk:
    return HostWalk.start(
        walk_id, "h1", mode="converting", slots=SLOTS, profile="h200-slice-host", system_id="abc123", at=AT
    )


def walk_in(state: str, *, parity_early: bool = False) -> HostWalk:
    w = started()
    if state == STOPPED:
        w.deploy_result("failed", "Failed deployment", AT)
        return w
    if state == REDEPLOY_REQUESTED:
        return w
    w.deploy_result("deployed", "", AT)
    w.rediscovery_asked(ACT)
    if parity_early:
        w.parity(ACT, True, "parity passed (0 warning(s))", AT)
    if state == DEPLOYED:
        return w
    w.topology(ACT, True, "discovery found 2 candidate(s)", AT)
    if state == REDISCOVERED:
        return w
    w.parity(ACT, True, "parity passed (0 warning(s))", AT)
    if state == PARITY_PASSED:
        return w
    w.reapproval("slice", [], AT)
    assert state == REAPPROVED
    return w


EVENTS = {
    "deployed": lambda w: w.deploy_result("deployed", "", AT),
    "deploy_failed": lambda w: w.deploy_result("failed", "Failed deployment", AT),
    "topology_ok": lambda w: w.topology(ACT, True, "discovery found 2 candidate(s)", AT),
    "topology_not_applied": lambda w: w.topology(ACT, False, "the topology report was not applied: stale", AT),
    "topology_not_asked": lambda w: w.topology(None, True, "the agent's start-up report", AT),
    "parity_ok": lambda w: w.parity(ACT, True, "parity passed (0 warning(s))", AT),
    "parity_failed": lambda w: w.parity(ACT, False, "parity reported 1 failure(s): kvm", AT),
    "parity_of_another_ask": lambda w: w.parity("parity-periodic", False, "parity reported 1 failure(s): kvm", AT),
    "left_converting": lambda w: w.host_left_converting("baremetal", "ops", AT),
}

# (state, event) -> the state after; a pair not listed leaves the walk as it was (a repeat, or not its news).
MOVES = {
    (REDEPLOY_REQUESTED, "deployed"): DEPLOYED,
    (REDEPLOY_REQUESTED, "deploy_failed"): STOPPED,
    (REDEPLOY_REQUESTED, "left_converting"): STOPPED,
    (DEPLOYED, "topology_ok"): REDISCOVERED,
    (DEPLOYED, "topology_not_applied"): STOPPED,
    (DEPLOYED, "parity_failed"): STOPPED,
    (DEPLOYED, "left_converting"): STOPPED,
    (REDISCOVERED, "parity_ok"): PARITY_PASSED,
    (REDISCOVERED, "parity_failed"): STOPPED,
    (REDISCOVERED, "left_converting"): STOPPED,
    (PARITY_PASSED, "left_converting"): STOPPED,
}
WHY = {"deploy_failed": "Failed deployment", "topology_not_applied": "stale", "parity_failed": "kvm"}


@pytest.mark.parametrize("state", STATES)
@pytest.mark.parametrize("event", sorted(EVENTS))
def test_every_event_in_every_state(state: str, event: str) -> None:
    w = walk_in(state)
    steps, sent = len(w.steps), list(w.commands)
    EVENTS[event](w)
    after = MOVES.get((state, event), state)
    assert w.state == after
    # A step is recorded exactly when the walk moved: its steps are the node's history of the walk.
    assert len(w.steps) == steps + (after != state)
    if after == STOPPED and state != STOPPED:
        assert w.steps[-1].reason == w.reason and WHY.get(event, "ops") in w.reason
        assert w.commands == sent  # a stop asks nothing more: no retry behind anyone's back


def test_a_clean_walk_asks_the_deploy_the_rediscovery_and_the_slots_it_had_in_that_order() -> None:
    w = walk_in(PARITY_PASSED)
    assert w.commands == [
        RequestDeploy(WALK, "h1", "abc123", "h200-slice-host"),
        AskRediscovery(WALK, "h1"),
        Reapprove(WALK, "h1", SLOTS),
    ]
    w.reapproval("slice", [], AT)
    assert [(s.from_state, s.to_state) for s in w.steps] == [
        (None, REDEPLOY_REQUESTED),
        (REDEPLOY_REQUESTED, DEPLOYED),
        (DEPLOYED, REDISCOVERED),
        (REDISCOVERED, PARITY_PASSED),
        (PARITY_PASSED, REAPPROVED),
    ]


def test_a_passing_parity_before_the_topology_is_kept_until_rediscovery_is_in() -> None:
    w = walk_in(DEPLOYED, parity_early=True)
    assert w.state == DEPLOYED and not any(isinstance(c, Reapprove) for c in w.commands)
    EVENTS["topology_ok"](w)
    assert w.state == PARITY_PASSED and w.commands[-1] == Reapprove(WALK, "h1", SLOTS)


def test_a_stopped_walk_stays_stopped_when_a_later_run_passes() -> None:
    w = walk_in(REDISCOVERED)
    EVENTS["parity_failed"](w)
    EVENTS["parity_ok"](w)
    assert w.state == STOPPED and "parity failed: parity reported 1 failure(s): kvm" in w.reason


@pytest.mark.parametrize(
    ("mode", "problems", "why"),
    [
        ("converting", ["node h1 is not ready for slot approval: commissioning preflight failed"], "preflight"),
        ("converting", [], "the host stayed converting"),
    ],
)
def test_a_refused_reapproval_stops_the_walk(mode: str, problems: list[str], why: str) -> None:
    w = walk_in(PARITY_PASSED)
    w.reapproval(mode, problems, AT)
    assert w.state == STOPPED and why in w.reason


@pytest.mark.parametrize(
    ("profile", "system_id", "slots", "why"),
    [
        (None, "abc123", SLOTS, "GPUAAS_SLICE_HOST_PROFILE"),
        ("h200-slice-host", None, SLOTS, "no MAAS machine"),
        ("h200-slice-host", "abc123", (), "nothing to re-approve"),
    ],
)
def test_a_walk_that_cannot_start_is_recorded_stopped_with_why(profile, system_id, slots, why) -> None:
    w = HostWalk.start(WALK, "h1", mode="converting", slots=slots, profile=profile, system_id=system_id, at=AT)
    assert w.state == STOPPED and why in w.reason and not w.commands
    assert [(s.from_state, s.to_state) for s in w.steps] == [(None, STOPPED)]


def test_only_a_converting_host_walks_and_answers_come_in_their_states() -> None:
    with pytest.raises(WalkError):
        HostWalk.start(WALK, "h1", mode="slice", slots=SLOTS, profile="p", system_id="abc123", at=AT)
    with pytest.raises(WalkError):
        walk_in(REDISCOVERED).reapproval("slice", [], AT)
    with pytest.raises(WalkError):
        walk_in(REDEPLOY_REQUESTED).rediscovery_asked(ACT)


def test_candidates_are_matched_to_the_slots_by_gpu_or_for_an_emulated_slot_by_id() -> None:
    cands = [
        {"candidate_id": "c-17", "gpu_pci_address": "0000:17:00.0"},
        {"candidate_id": "c-3d", "gpu_pci_address": "0000:3d:00.0"},
        {"candidate_id": "lab-0", "gpu_pci_address": None},
        {"candidate_id": "c-new", "gpu_pci_address": "0000:99:00.0"},
    ]
    groups, missing = match_candidates(
        SLOTS + (ApprovedSlot("lab-0", None), ApprovedSlot("gone", "0000:aa:00.0")), cands
    )
    assert groups == {"h200_1g_24c_64g_plain": ["c-17"], None: ["c-3d", "lab-0"]}
    assert missing == ["gone"]  # and the new GPU is not approved: that is ops' call


# --- the handlers, with the in-memory unit of work ------------------------------------------------------------


@dataclass
class FakeWalks:
    """The walk's world: its rows, the asks it made and the answers the rest of the scheduler gives."""

    rows: dict[str, HostWalk] = field(default_factory=dict)
    operations: dict[str, str] = field(default_factory=dict)
    steps: list[tuple[str | None, str, str]] = field(default_factory=list)
    rediscovery: str | list[str] = ACT
    approval: tuple[str, list[str]] = ("slice", [])
    asked: list[Any] = field(default_factory=list)

    async def by_operation(self, operation_id: str) -> HostWalk | None:
        walk_id = self.operations.get(operation_id)
        return self.rows.get(walk_id) if walk_id else None

    async def by_rediscovery(self, node_id: str, action_id: str) -> HostWalk | None:
        return next(
            (w for w in self.rows.values() if w.node_id == node_id and w.state_.rediscover_action_id == action_id),
            None,
        )

    async def save(self, walk: HostWalk, operation_id: str | None = None) -> None:
        self.rows[walk.walk_id] = walk
        if operation_id:
            self.operations[operation_id] = walk.walk_id
        self.steps += [(s.from_state, s.to_state, s.reason) for s in walk.steps]
        walk.steps.clear()

    async def ask_rediscovery(self, walk: HostWalk) -> str | list[str]:
        self.asked.append(("rediscover", walk.node_id))
        return self.rediscovery

    async def reapprove(self, command: Reapprove) -> tuple[str, list[str]]:
        self.asked.append(("reapprove", command.slots))
        return self.approval


class World:
    def __init__(self, walks: FakeWalks) -> None:
        self.walks = walks
        self.walker = HostWalker(WalkPolicy(slice_host_profile="h200-slice-host"), walks_of=lambda ctx: walks)
        self.sent: list[Envelope] = []

    async def start(self) -> None:
        uow = FakeUnitOfWork(None, "scheduler")
        async with uow:
            await carry_out(self.walks, started(), uow.events, self.walker.policy)
            await uow.commit()
        self.sent += [p.envelope for p in uow.events.pending]

    async def send(self, type_: str, payload: Any, handler: Any) -> None:
        env = Envelope.wrap(type_, payload.model_dump(mode="json"), producer="test", correlation_id="c")
        uow = FakeUnitOfWork(None, "scheduler")
        await deliver(handler, HandlerContext(env, payload, type_, "scheduler-test", 1), uow)
        self.sent += [p.envelope for p in uow.events.pending]

    async def deploy_result(self, status: str = "deployed", message: str | None = None) -> None:
        res = m.MaasDeployResult(
            operation_id=operation_id_of(WALK),
            allocation_id=uuid.UUID(WALK),
            system_id="abc123",
            node_id="h1",
            resolution="polled",
            status=status,
            status_message=message,
            attempts=1,
        )
        await self.send("maas.deploy_result", res, self.walker.on_deploy_result)

    async def topology(self, task_id: str | None = ACT, blockers: tuple[str, ...] = (), applied: str = "applied"):
        ev = m.NodeTopologyReported(node_id="h1", task_id=task_id, discovered_at=AT, blockers=list(blockers))

        async def handler(ctx: HandlerContext) -> None:
            await self.walker.on_topology(ctx, ev, applied)

        await self.send("node.topology_reported", ev, handler)

    async def parity(self, failing: tuple[str, ...] = (), task_id: str | None = ACT, applied: str = "applied"):
        checks = [m.ParityCheck(check=c, status="FAIL", detail="missing") for c in failing]
        checks.append(m.ParityCheck(check="vfio_binding", status="WARN", detail="released"))
        ev = m.NodeParityReported(
            node_id="h1", task_id=task_id, checked_at=AT, checks=checks, failures=len(failing), warnings=1
        )

        async def handler(ctx: HandlerContext) -> None:
            await self.walker.on_parity(ctx, ev, applied)

        await self.send("node.parity_reported", ev, handler)

    def state(self) -> str:
        return self.walks.rows[WALK].state


async def test_the_messages_walk_the_host_back_and_each_answer_is_one_unit_of_work() -> None:
    w = World(FakeWalks())
    await w.start()
    deploy = w.sent[-1]
    assert deploy.type == "maas.deploy_requested"
    assert deploy.payload["profile"] == "h200-slice-host" and deploy.payload["allocation_id"] == WALK
    assert deploy.payload["operation_id"] == operation_id_of(WALK)
    await w.deploy_result()
    assert w.state() == DEPLOYED and w.walks.asked == [("rediscover", "h1")]
    await w.deploy_result()  # the gateway's answer sent again: taken already
    assert w.walks.asked == [("rediscover", "h1")]
    await w.topology(task_id=None)  # the agent's own start-up report is not the walk's rediscovery
    assert w.state() == DEPLOYED
    # Blockers of GPUs the host cannot offer now do not stop it: the slots it had are the re-approval's question.
    await w.topology(blockers=("GPU 0000:9a:00.0 has no free nvme",))
    await w.parity()
    assert w.state() == REAPPROVED and w.walks.asked[-1] == ("reapprove", SLOTS)
    assert [s[1] for s in w.walks.steps] == [REDEPLOY_REQUESTED, DEPLOYED, REDISCOVERED, PARITY_PASSED, REAPPROVED]


async def test_a_deploy_result_of_a_tenants_deploy_is_not_the_walks() -> None:
    w = World(FakeWalks())
    res = m.MaasDeployResult(
        operation_id="deploy-of-an-allocation",
        allocation_id=uuid.uuid4(),
        system_id="abc123",
        node_id="h1",
        resolution="direct",
        status="deployed",
        attempts=1,
    )
    await w.send("maas.deploy_result", res, w.walker.on_deploy_result)
    assert not w.walks.rows and not w.sent


@pytest.mark.parametrize(
    ("drive", "why"),
    [
        (lambda w: w.deploy_result("failed", "Failed deployment: curtin exited 3"), "curtin exited 3"),
        (lambda w: w.deploy_result_then(w.parity(failing=("kvm", "vfio_modules"))), "kvm, vfio_modules"),
        (lambda w: w.deploy_result_then(w.parity(applied="stale")), "was not applied: older than"),
        (lambda w: w.deploy_result_then(w.topology(applied="unknown_node")), "for a node this scheduler does not"),
    ],
)
async def test_the_first_failure_stops_the_walk_with_its_reason_and_nothing_is_asked_again(drive, why) -> None:
    w = World(FakeWalks())
    w.deploy_result_then = lambda then: _chain(w.deploy_result(), then)  # type: ignore[attr-defined]
    await w.start()
    await drive(w)
    assert w.state() == STOPPED and why in w.walks.rows[WALK].reason, w.walks.rows[WALK].reason
    asked = list(w.walks.asked)
    await w.topology()
    await w.parity()
    assert w.state() == STOPPED and w.walks.asked == asked and not any(a[0] == "reapprove" for a in asked)


async def _chain(first, then) -> None:
    await first
    await then


async def test_a_refused_rediscovery_or_reapproval_stops_the_walk_with_the_refusal() -> None:
    w = World(FakeWalks(rediscovery=["a rediscover of h1 asked by ops is still open"]))
    await w.start()
    await w.deploy_result()
    assert w.state() == STOPPED and "still open" in w.walks.rows[WALK].reason

    w = World(FakeWalks(approval=("converting", ["node h1 is not ready for slot approval: no commissioning"])))
    await w.start()
    await w.deploy_result()
    await w.parity()  # before the topology: kept
    assert w.state() == DEPLOYED
    await w.topology()
    assert w.state() == STOPPED and "re-approval refused: node h1 is not ready" in w.walks.rows[WALK].reason
