"""The claim audit: the scheduler asks the allocator about the allocations it holds claims for and settles the
claims of those that ended or that the allocator never heard of (domain/claim_audit.py has the rules).

Every replica runs it. Each round takes a batch of due claims with SKIP LOCKED and stamps them, so replicas ask
about different allocations; each settlement then runs in its own unit of work under the allocation's lock and
re-reads the claims there, so a lifecycle event handled meanwhile (or another replica) is never undone: exactly
one of them frees a given claim.
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from gpuaas_common.contract import messages as m
from gpuaas_common.logging import get_logger
from gpuaas_common.outbox import EventCollector, OutboxWriter

from ..adapters import claim_audit as repo
from ..adapters.repository import scheduler_repositories
from ..domain.claim_audit import AuditFacts, Settlement, settle
from . import host_modes, slot_announcements

log = get_logger(__name__)

ACTOR = "claim-audit"
Ask = Callable[[Sequence[uuid.UUID]], Awaitable[dict[uuid.UUID, m.AllocationSummary] | None]]


@dataclass(frozen=True)
class AuditPolicy:
    every_s: float = 300.0
    min_age_s: float = 60.0
    orphan_after_s: float = 900.0
    batch: int = 500


@dataclass
class AuditRound:
    asked: int = 0
    released: list[str] = field(default_factory=list)
    reported: list[str] = field(default_factory=list)
    unanswered: bool = False


async def audit_claims(uow_factory: Callable[[], Any], ask: Ask, policy: AuditPolicy) -> AuditRound:
    """One audit round over every allocation due, batch by batch."""
    out = AuditRound()
    while True:
        async with uow_factory() as uow:
            due = await repo.take_due(uow.conn, every_s=policy.every_s, min_age_s=policy.min_age_s, limit=policy.batch)
            await uow.commit()
        if not due:
            return out
        answers = await ask([d.allocation_id for d in due])
        if answers is None:
            out.unanswered = True  # stamped anyway: asked again once `every_s` has passed
            return out
        out.asked += len(due)
        now = datetime.now(timezone.utc)
        for d in due:
            owner = answers.get(d.allocation_id)
            facts = AuditFacts(
                owner_state=owner.state if owner else None,
                owner_node=owner.node_id if owner else None,
                claim_nodes=d.nodes,
                claims_age_s=d.claims_age_s,
                owner_changed_age_s=(now - owner.updated_at).total_seconds() if owner else 0.0,
            )
            verdict = settle(facts, policy.orphan_after_s, policy.min_age_s)
            if verdict.action == "report":
                log.warning("claim_audit_disagreement", allocation_id=str(d.allocation_id), reason=verdict.reason)
                out.reported.append(str(d.allocation_id))
            elif verdict.action == "release":
                async with uow_factory() as uow:
                    freed = await release_settled(uow.conn, d.allocation_id, verdict, uow.events)
                    await uow.commit()
                if freed:
                    out.released.append(str(d.allocation_id))
        if len(due) < policy.batch:
            return out


async def release_settled(
    conn: Any, allocation_id: uuid.UUID, verdict: Settlement, events: EventCollector | OutboxWriter
) -> int:
    """Free the allocation's live claims as the audit settled them (`NodeClaims.settle`); how many were freed (0:
    nothing was held any more, e.g. its lifecycle event was applied in the meantime). The hosts whose slots it
    blocked have their slots announced through `events`."""
    repos = scheduler_repositories(conn)
    await repos.claims.lock_allocation(allocation_id)
    claims = await repos.claims.load(allocation_id)
    if not claims.claims:
        return 0
    claims.settle(verdict.reason, machine_returned=verdict.machine_returned, actor=ACTOR)
    freed = await repos.claims.save(claims)
    if verdict.machine_returned:
        for node_id in claims.whole_nodes:
            await host_modes.return_from_baremetal(repos.hosts, node_id, allocation_id)
    await repos.nodes.refresh(claims.node_ids)
    for node_id in claims.blocking_nodes:
        await slot_announcements.announce(events, await repos.slots.announcement(node_id, "claim_audit", ACTOR))
    log.warning(
        "claims_settled_by_audit",
        allocation_id=str(allocation_id),
        reason=verdict.reason,
        claims=freed,
        slots_blocked=[s.slot_id for s in claims.slots],
    )
    return freed
