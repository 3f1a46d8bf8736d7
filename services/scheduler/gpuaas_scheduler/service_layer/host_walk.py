"""The walk of a converting host back to slice mode (domain/host_walk.py): one message in, one unit of work,
commands out.

- `sweep` starts a walk for every converting slice host that entered converting after its last walk started,
  read from the database as the steering sweep's parity after a mode change is: a replica that died between
  the mode change and the walk leaves nothing owed. It also stops open walks whose host ops moved elsewhere.
- `maas.deploy_result` of a walk's deploy (found by operation id; every other deploy is a tenant's, the
  allocator's) moves it on and asks the host's agent for a rediscovery (steering's ask, so the node's history
  shows it like an operator's).
- `node.topology_reported` / `node.parity_reported` naming that rediscovery move it on; once both passed, the
  slots the host had when it left slice mode are approved again through the admin approval (its rules, the
  readiness gate, the VFIO binding on entering slice mode), as `scheduler`.

The deploy goes to the gateway as `maas.deploy_requested` with the slice-host site profile
(GPUAAS_SLICE_HOST_PROFILE) and the walk's id where a tenant's deploy has its allocation's.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from gpuaas_common.bus import HandlerContext
from gpuaas_common.contract import derived_event_id, utcnow
from gpuaas_common.contract import messages as m
from gpuaas_common.logging import get_logger
from gpuaas_common.outbox import EventCollector

from ..adapters.repository import repositories_of
from ..domain import steering as rules
from ..domain.host_walk import (
    AskRediscovery,
    HostWalk,
    Reapprove,
    RequestDeploy,
    match_candidates,
)
from . import steering
from .admin.models import AdminError, ApproveIn
from .ports import EvidenceRepositories, EvidenceUnitOfWork

log = get_logger(__name__)


@dataclass(frozen=True)
class WalkPolicy:
    # The gateway's site profile for slice hosts; None: converting hosts are onboarded by hand.
    slice_host_profile: str | None = None
    maas_site: str = "default"
    allow_emulated: bool = False
    steering: steering.SteeringPolicy = field(default_factory=steering.SteeringPolicy)
    sweep_batch: int = 20


class Walks(Protocol):
    """What a walk reads and asks of the rest of the scheduler, in the caller's unit of work."""

    async def by_operation(self, operation_id: str) -> HostWalk | None: ...

    async def by_rediscovery(self, node_id: str, action_id: str) -> HostWalk | None: ...

    async def save(self, walk: HostWalk, operation_id: str | None = None) -> None: ...

    async def ask_rediscovery(self, walk: HostWalk) -> str | list[str]:
        """The ask's id, or why it was refused."""
        ...

    async def reapprove(self, command: Reapprove) -> tuple[str, list[str]]:
        """The host's mode after, and what refused the approval (nothing written then)."""
        ...


def operation_id_of(walk_id: str) -> str:
    return f"walk-{walk_id}"


class SqlWalks:
    """The walk's world in a unit of work: its repositories (`repos.walks`, `repos.asks`) and its outbox."""

    def __init__(self, repos: EvidenceRepositories, events: EventCollector, policy: WalkPolicy) -> None:
        self.repos, self.events, self.policy = repos, events, policy

    async def by_operation(self, operation_id: str) -> HostWalk | None:
        return await self.repos.walks.by_operation(operation_id)

    async def by_rediscovery(self, node_id: str, action_id: str) -> HostWalk | None:
        return await self.repos.walks.by_rediscovery(node_id, action_id)

    async def save(self, walk: HostWalk, operation_id: str | None = None) -> None:
        await self.repos.walks.save(walk, operation_id)

    async def ask_rediscovery(self, walk: HostWalk) -> str | list[str]:
        try:
            row = await steering.ask(
                self.repos.asks,
                self.events,
                self.policy.steering,
                walk.node_id,
                rules.REDISCOVER,
                actor="scheduler",
                reason=f"host walk {walk.walk_id}: the slice-host redeploy is done, its topology and parity are new",
            )
        except steering.AskRefused as exc:
            return exc.problems
        except steering.UnknownNode:
            return [f"no node {walk.node_id}"]
        return str(row["action_id"])

    async def reapprove(self, command: Reapprove) -> tuple[str, list[str]]:
        candidates = await self.repos.walks.candidates(command.node_id)
        groups, missing = match_candidates(command.slots, candidates)
        if missing:
            return "converting", [f"rediscovery found no candidate for slot(s) {', '.join(missing)}"]
        # Approval's events (the VFIO binding) go out only with an approval that stands.
        scratch = EventCollector(self.events.producer, self.events.correlation_id, self.events.causation_id)
        problems: list[str] = []
        out: dict[str, Any] = {}
        # A refused approval leaves no slot of the walk half-approved, while the walk's stop still commits.
        await self.repos.walks.begin_reapproval()
        try:
            for profile, ids in sorted(groups.items(), key=lambda g: g[0] or ""):
                out = await self._approve(command, profile, sorted(ids), scratch)
                problems += [
                    f"slot {r['slot_id']} would be {r['status']}: {'; '.join(r['problems'])}"
                    for r in out["results"]
                    # awaiting_wipe: approved, freed once the host proves the site's wipe of its disk.
                    if r["status"] not in ("available", "awaiting_wipe")
                ]
        except AdminError as exc:
            problems = [exc.message]
        if problems:
            await self.repos.walks.undo_reapproval()
            return "converting", problems
        await self.repos.walks.keep_reapproval()
        self.events.pending.extend(scratch.pending)
        return str(out.get("mode", "converting")), list(out.get("mode_blockers") or [])

    async def _approve(
        self, command: Reapprove, profile: str | None, ids: list[str], events: EventCollector
    ) -> dict[str, Any]:
        from .admin import slots as admin_slots  # the admin package imports the service layer's modules

        body = ApproveIn(
            actor="scheduler",
            reason=f"host walk {command.walk_id}: re-approved after redeploy, rediscovery and parity",
            candidate_ids=ids,
            profile=profile,
        )
        # The admin approval still takes a connection (until the admin layer moves to ports): the one place the
        # walk reaches past its ports, to the same unit of work's connection (SchedulerRepositories.conn).
        conn: Any = self.repos.conn  # type: ignore[attr-defined]
        out: dict[str, Any] = await admin_slots.approve(
            conn, command.node_id, body, events=events, allow_emulated=self.policy.allow_emulated
        )
        return out


async def carry_out(walks: Walks, walk: HostWalk, events: EventCollector, policy: WalkPolicy) -> None:
    """Send what the walk asked for, feed the answers back into it, then save it with its steps."""
    operation_id = None
    while walk.commands:
        cmd = walk.commands.pop(0)
        if isinstance(cmd, RequestDeploy):
            operation_id = operation_id_of(cmd.walk_id)
            await events.add(
                "maas.deploy_requested",
                m.MaasDeployRequested(
                    operation_id=operation_id,
                    allocation_id=uuid.UUID(cmd.walk_id),
                    site=policy.maas_site,
                    system_id=cmd.system_id,
                    node_id=cmd.node_id,
                    profile=cmd.profile,
                ),
                aggregate_id=cmd.node_id,
                correlation_id=operation_id,
                event_id=derived_event_id(operation_id, "deploy"),
            )
        elif isinstance(cmd, AskRediscovery):
            asked = await walks.ask_rediscovery(walk)
            if isinstance(asked, str):
                walk.rediscovery_asked(asked)
            else:
                walk.rediscovery_refused(asked, utcnow())
        else:
            mode, problems = await walks.reapprove(cmd)
            walk.reapproval(mode, problems, utcnow())
    await walks.save(walk, operation_id)
    log.info("host_walk", node_id=walk.node_id, walk_id=walk.walk_id, state=walk.state, reason=walk.reason)


class HostWalker:
    """The walk's message handlers. `walks_of` gives the walk's world for a message's unit of work (SqlWalks on its
    repositories; a fake in unit tests)."""

    def __init__(self, policy: WalkPolicy, walks_of: Callable[[HandlerContext], Walks] | None = None) -> None:
        self.policy = policy
        self.walks_of = walks_of or (lambda ctx: SqlWalks(repositories_of(ctx.uow), ctx.outbox, policy))

    async def on_deploy_result(self, ctx: HandlerContext) -> None:
        res: m.MaasDeployResult = ctx.payload
        walks = self.walks_of(ctx)
        walk = await walks.by_operation(res.operation_id)
        if walk is None:
            return  # a tenant's deploy: the allocator's business
        walk.deploy_result(res.status, res.status_message or res.reason_code or res.maas_status_name or "", utcnow())
        await carry_out(walks, walk, ctx.outbox, self.policy)

    async def on_topology(self, ctx: HandlerContext, ev: m.NodeTopologyReported, applied: str) -> None:
        """After the report was recorded (evidence.record_topology's `applied`)."""
        if not ev.task_id:
            return  # the agent's own start-up report: no walk asked for it
        walks = self.walks_of(ctx)
        walk = await walks.by_rediscovery(ev.node_id, ev.task_id)
        if walk is None:
            return
        v = rules.topology_verdict(applied, len(ev.candidate_slots), ev.blockers)
        # Blockers name GPUs the host cannot offer as slots (one without a free disk); whether the slots it had are
        # back is the re-approval's question, so only a report not applied stops the walk here.
        walk.topology(ev.task_id, applied == "applied", v.outcome, utcnow())
        await carry_out(walks, walk, ctx.outbox, self.policy)

    async def on_parity(self, ctx: HandlerContext, ev: m.NodeParityReported, applied: str) -> None:
        """After the report was recorded: a pass counts only when it was applied as the host's current evidence."""
        if not ev.task_id:
            return
        walks = self.walks_of(ctx)
        walk = await walks.by_rediscovery(ev.node_id, ev.task_id)
        if walk is None:
            return
        failed = [c.check for c in ev.checks if c.status == "FAIL"]
        v = rules.parity_verdict(applied, ev.failures, failed, ev.warnings)
        walk.parity(ev.task_id, v.status == rules.SUCCEEDED, v.outcome, utcnow())
        await carry_out(walks, walk, ctx.outbox, self.policy)


async def sweep(unit_of_work: Callable[[], Any], policy: WalkPolicy) -> dict[str, int]:
    """Start the walks owed, stop those whose host left converting; one transaction."""
    async with unit_of_work() as uow:
        started = await _start_owed(uow, policy)
        stopped = 0
        for walk, mode, changed_by in await uow.repos.walks.off_course(policy.sweep_batch):
            walk.host_left_converting(mode, changed_by or "someone", utcnow())
            await uow.repos.walks.save(walk)
            stopped += 1
        await uow.commit()
    return {"walks_started": started, "walks_stopped": stopped}


async def _start_owed(uow: EvidenceUnitOfWork, policy: WalkPolicy) -> int:
    walks = SqlWalks(uow.repos, uow.events, policy)
    started = 0
    for node in await uow.repos.walks.owed_a_walk(policy.sweep_batch):
        walk = HostWalk.start(
            str(uuid.uuid4()),
            node["node_id"],
            mode=node["mode"],
            slots=await uow.repos.walks.slots_left_behind(node["node_id"]),
            profile=policy.slice_host_profile,
            system_id=node["maas_system_id"],
            at=utcnow(),
        )
        await carry_out(walks, walk, uow.events, policy)
        started += 1
    return started
