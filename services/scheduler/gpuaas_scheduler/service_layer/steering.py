"""Asking a host for rediscovery, a parity run or a commissioning, and recording what it answered.

An ask is a `node_actions` row and its command in the same transaction's outbox: the task to the host's agent
(`slice.topology_discover`, `slice.parity_check`) or the commissioning to the MAAS gateway
(`maas.commission_requested`). The row's id is the task id (or MAAS operation id), a random one: only the host a
task goes to reads its subject, so no other host learns it, nor can pre-empt the report's Nats-Msg-Id the agent
derives from it; and a report closes the ask only when it names that id and comes from that node.

Parity is asked by the scheduler itself too (`sweep`): after every mode change of a slice host, and, with
`parity_interval_s`, whenever its last report or ask is older than that. Both are read from the database, so a
replica that died between a mode change and the ask leaves nothing owed: the next sweep of any replica asks.
The same sweep asks a host again for a slot wipe whose task passed its deadline unanswered.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from gpuaas_common.contract import derived_event_id, utcnow
from gpuaas_common.contract import messages as m
from gpuaas_common.logging import get_logger
from gpuaas_common.outbox import EventCollector

from ..adapters.node_actions import NodeActionRepository
from ..domain import steering as rules
from ..domain.steering import COMMISSION, DECIDED_BY, PARITY, REDISCOVER, Verdict
from .ports import EvidenceUnitOfWork, NodeAsks
from .slot_wipe import reask_overdue

log = get_logger(__name__)
PREFLIGHT_SCRIPT = "50-gpuaas-slice-firmware-preflight"


@dataclass(frozen=True)
class SteeringPolicy:
    """The scheduler's settings as the asks read them."""

    task_deadline_s: float = 600.0
    commission_deadline_s: float = 3600.0
    maas_site: str = "default"
    commission_scripts: tuple[str, ...] = (PREFLIGHT_SCRIPT,)
    # None: no periodic parity (a mode change still asks for one).
    parity_interval_s: float | None = None
    sweep_batch: int = 50


class UnknownNode(Exception):
    pass


class AskRefused(Exception):
    def __init__(self, node_id: str, kind: str, problems: list[str]) -> None:
        super().__init__(f"{kind} of {node_id} refused: {'; '.join(problems)}")
        self.node_id, self.kind, self.problems = node_id, kind, problems


@dataclass
class _Ask:
    action_id: str
    node_id: str
    deadline_s: float
    maas_system_id: str | None = None


async def ask(
    asks: NodeAsks | Any,
    events: EventCollector,
    policy: SteeringPolicy,
    node_id: str,
    kind: str,
    *,
    actor: str,
    reason: str,
) -> dict[str, Any]:
    """Record the ask and queue its command; the caller holds the node lock. Raises UnknownNode, or AskRefused
    with every reason (nothing written). `asks`: the unit of work's, or (the admin layer's callers, until they move
    to ports) a connection to wrap."""
    if not hasattr(asks, "record_part"):
        asks = NodeActionRepository(asks)
    facts = await asks.facts(node_id, kind)
    if facts is None:
        raise UnknownNode(node_id)
    problems = rules.request_problems(facts, kind)
    if problems:
        raise AskRefused(node_id, kind, problems)
    deadline_s = policy.commission_deadline_s if kind == COMMISSION else policy.task_deadline_s
    action_id = f"{kind}-{uuid.uuid4().hex}"
    row = await asks.insert(action_id, node_id, kind, actor, reason, deadline_s)
    if row is None:  # another replica's ask won the race after the facts were read
        raise AskRefused(node_id, kind, [f"a {kind} of {node_id} is already open"])
    await _send(events, policy, kind, _Ask(action_id, node_id, deadline_s, facts.maas_system_id))
    log.info("node_ask_sent", node_id=node_id, kind=kind, action_id=action_id, actor=actor)
    return row


async def _send(events: EventCollector, policy: SteeringPolicy, kind: str, a: _Ask) -> None:
    deadline = utcnow() + timedelta(seconds=a.deadline_s)
    event_id = derived_event_id(a.action_id, kind)
    if kind == COMMISSION:
        assert a.maas_system_id is not None  # the rules refused a node without one
        await events.add(
            "maas.commission_requested",
            m.MaasCommissionRequested(
                operation_id=a.action_id,
                site=policy.maas_site,
                system_id=a.maas_system_id,
                node_id=a.node_id,
                commissioning_scripts=list(policy.commission_scripts),
            ),
            aggregate_id=a.node_id,
            correlation_id=a.action_id,
            event_id=event_id,
        )
        return
    type_, model = (
        ("slice.topology_discover", m.SliceTopologyDiscover)
        if kind == REDISCOVER
        else ("slice.parity_check", m.SliceParityCheck)
    )
    await events.add(
        type_,
        model(task_id=a.action_id, node_id=a.node_id, deadline=deadline),
        aggregate_id=a.node_id,
        correlation_id=a.action_id,
        event_id=event_id,
        node_id=a.node_id,
    )


# --- answers -------------------------------------------------------------------------------------------------


async def _record(
    asks: NodeAsks, action_id: str | None, node_id: str, part: str, value: dict[str, Any], v: Verdict
) -> str | None:
    if not action_id:
        return None  # the agent's own start-up report: nobody asked
    kind = await asks.kind_of(action_id, node_id)
    if kind is None:
        return None  # another sender's task (break-glass ops), or not this node's ask
    settle = (v.status, v.outcome) if DECIDED_BY[kind] == part else None
    await asks.record_part(action_id, node_id, part, {**value, "verdict": v.status, "why": v.outcome}, settle)
    if settle:
        log.info("node_ask_answered", node_id=node_id, kind=kind, action_id=action_id, status=v.status)
    return kind


async def parity_answered(asks: NodeAsks, ev: m.NodeParityReported, applied: str) -> str | None:
    failed = [c.check for c in ev.checks if c.status == "FAIL"]
    v = rules.parity_verdict(applied, ev.failures, failed, ev.warnings)
    value = {"failures": ev.failures, "warnings": ev.warnings, "failed_checks": failed, "applied": applied}
    return await _record(asks, ev.task_id, ev.node_id, "parity", value, v)


async def topology_answered(asks: NodeAsks, ev: m.NodeTopologyReported, applied: str) -> str | None:
    v = rules.topology_verdict(applied, len(ev.candidate_slots), ev.blockers)
    value = {"candidates": len(ev.candidate_slots), "blockers": ev.blockers, "applied": applied}
    return await _record(asks, ev.task_id, ev.node_id, "topology", value, v)


async def preflight_answered(asks: NodeAsks, ev: m.NodeSlicePreflightReported) -> str | None:
    """The gateway echoes the commissioning's operation id; the ask names its node."""
    row = await asks.get(ev.operation_id)
    if row is None or row["kind"] != COMMISSION:
        return None
    v = rules.preflight_verdict(ev.status, ev.reasons)
    value = {"status": ev.status, "reasons": ev.reasons[:20], "warnings": ev.warnings[:20]}
    return await _record(asks, ev.operation_id, row["node_id"], "preflight", value, v)


# --- the scheduler's own asks ----------------------------------------------------------------------------------


async def sweep(unit_of_work: Callable[[], Any], policy: SteeringPolicy) -> dict[str, int]:
    """Close overdue asks; ask parity of every slice host owed one. One transaction, so an ask and its task
    commit together; nodes another replica holds are skipped this round. Then ask again the slot wipes whose
    task passed its deadline unanswered (service_layer/slot_wipe.py)."""
    async with unit_of_work() as uow:
        expired, asked = await _parity_round(uow, policy)
        await uow.commit()
    # Its own transaction: a slot wipe's re-ask never waits on, nor rolls back, the parity asks.
    async with unit_of_work() as uow:
        reasked = await reask_overdue(uow.repos.wipes, uow.events, limit=policy.sweep_batch)
        await uow.commit()
    return {"expired": expired, "parity_asked": asked, "wipes_reasked": len(reasked)}


async def _parity_round(uow: EvidenceUnitOfWork, policy: SteeringPolicy) -> tuple[int, int]:
    """The asks expired and the parity runs asked."""
    asks = uow.repos.asks
    expired = await asks.expire_overdue({k: rules.expired_outcome(k) for k in rules.KINDS})
    for r in expired:
        log.warning("node_ask_expired", node_id=r["node_id"], kind=r["kind"], action_id=r["action_id"])
    asked = 0
    for node_id in await asks.due_for_parity(rules.SLICE_AGENT_MODES, policy.parity_interval_s, policy.sweep_batch):
        try:
            await ask(asks, uow.events, policy, node_id, PARITY, actor="scheduler", reason=_why_due(policy))
            asked += 1
        except (AskRefused, UnknownNode) as exc:  # the node changed since it was read; next round
            log.info("parity_ask_skipped", node_id=node_id, why=str(exc))
    return len(expired), asked


def _why_due(policy: SteeringPolicy) -> str:
    every = f", or none in {policy.parity_interval_s:.0f}s" if policy.parity_interval_s else ""
    return f"periodic parity: the host's mode changed since the last parity run was asked{every}"
