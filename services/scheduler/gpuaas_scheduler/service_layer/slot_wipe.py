"""The host's own wipe proof before a slot whose disk may hold someone else's data is placeable (domain/slot_wipe.py).

- `ask_wipe`: a `slice.slot_wipe` task to the slot's host, in the transaction that made the slot owe it (an
  approval that left it `awaiting_wipe`, a repair of a `cleanup_blocked` one): a committed change always has its
  ask, a rolled-back one never does.
- `raise_task`: the task of asks a `Host` recorded (its undrain out of maintenance, domain/host.py: every slot
  disk `MAINTENANCE_RETURN_RULES` says owes a wipe), raised in the transaction that saved them.
- `reask_overdue`: the steering sweep's re-ask of the open asks past their deadline (REASKED_WHEN_OVERDUE), the
  old ask closed `expired`, bounded per sweep.
- `wipe_reported`: the host's `node.slot_wipe_reported`, read from its own report subject (only that host's
  identity may publish there). It is taken only for the open asks of its task on that node; each slot is judged
  against the site's policy and freed, blocked or left as it is, logged with the proof and announced.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Any

from gpuaas_common.bus import PermanentError
from gpuaas_common.contract import derived_event_id, utcnow
from gpuaas_common.contract import messages as m
from gpuaas_common.logging import get_logger
from gpuaas_common.outbox import EventCollector, OutboxWriter

from ..adapters.slot_wipes import SlotWipeRepository
from ..domain.approval import DEFAULT_WIPE_POLICY, binding_problems
from ..domain.slot_wipe import REASKED_WHEN_OVERDUE, judge_wipe
from .ports import EvidenceRepositories, SlotWipes
from .slot_announcements import announce

log = get_logger(__name__)

# A wipe by the slowest accepted method (a zero-out of a large NVMe disk) takes hours; past this the agent drops
# the task as stale, and the steering sweep asks again (`reask_overdue`; a repair may sooner).
WIPE_TASK_DEADLINE_S = 6 * 3600.0
# A report sent just before the deadline may still be on its way; asking again that soon would cost a wipe.
WIPE_REASK_GRACE_S = 300.0


def new_task_id() -> str:
    return f"wipe-{uuid.uuid4().hex}"


async def ask_wipe(
    wipes: SlotWipes | Any,
    events: EventCollector,
    node_id: str,
    slots: Sequence[Mapping[str, Any]],
    *,
    cause: str,
    why: str,
    actor: str,
) -> str | None:
    """Ask the host to wipe these slots' disks (`slot_id`, `nvme_by_id`, `wipe_policy`: the effective one); the
    task id, or None for no slot. `wipes`: the unit of work's, or (the admin layer's callers, until they move to
    ports) a connection to wrap."""
    if not slots:
        return None
    if not hasattr(wipes, "open_asks_of_task"):
        wipes = SlotWipeRepository(wipes)
    task_id = new_task_id()
    await wipes.open_asks(task_id, node_id, slots, cause=cause, why=why, actor=actor)
    await raise_task(
        events, task_id, node_id, [(s["slot_id"], s["nvme_by_id"], s["wipe_policy"]) for s in slots], cause
    )
    return task_id


async def raise_task(
    events: EventCollector, task_id: str, node_id: str, slots: Sequence[tuple[str, str, str]], cause: str
) -> None:
    """The `slice.slot_wipe` task of asks already recorded (slot, disk, policy each), in their transaction."""
    task = m.SliceSlotWipe(
        task_id=task_id,
        node_id=node_id,
        deadline=utcnow() + timedelta(seconds=WIPE_TASK_DEADLINE_S),
        slots=[m.WipeSlot(slot_id=s, nvme_by_id=d, wipe_policy=p) for s, d, p in slots],  # type: ignore[arg-type]
    )
    await events.add(
        "slice.slot_wipe",
        task,
        aggregate_id=node_id,
        correlation_id=task_id,
        event_id=derived_event_id(task_id, "slot-wipe"),
        node_id=node_id,
    )
    log.info("slot_wipe_asked", node_id=node_id, task_id=task_id, cause=cause, slots=[s for s, _d, _p in slots])


async def reask_overdue(wipes: SlotWipes, events: EventCollector, *, limit: int) -> list[str]:
    """Ask again each wipe whose ask passed its deadline unanswered (at most `limit` slots a sweep): the old ask
    closed `expired`, one new task per node and cause. The new tasks' ids."""
    overdue = await wipes.lock_overdue(WIPE_TASK_DEADLINE_S + WIPE_REASK_GRACE_S, sorted(REASKED_WHEN_OVERDUE), limit)
    by_task: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for row in overdue:
        by_task.setdefault((row["node_id"], row["cause"], row["task_id"]), []).append(row)
    asked: list[str] = []
    for (node_id, cause, old_task), rows in sorted(by_task.items()):
        ids = [r["slot_id"] for r in rows]
        await wipes.expire(old_task, ids, "no report by the task's deadline: asked again")
        slots = [
            {
                "slot_id": r["slot_id"],
                "nvme_by_id": r["nvme_by_id"],
                "wipe_policy": r["wipe_policy"] or DEFAULT_WIPE_POLICY,
            }
            for r in rows
            if "/by-id/" in (r["nvme_by_id"] or "")
        ]
        why = f"wipe task {old_task} passed its deadline unanswered ({cause}): asked again"
        task_id = await ask_wipe(wipes, events, node_id, slots, cause=cause, why=why, actor="scheduler")
        if task_id:
            asked.append(task_id)
        log.warning("slot_wipe_reasked", node_id=node_id, expired_task=old_task, task_id=task_id, slots=ids)
    return asked


def subject_node(subject: str) -> str | None:
    """The node a report subject belongs to (gpuaas.node.<node_id>.report.<kind>), None for any other subject."""
    parts = subject.split(".")
    if len(parts) == 5 and parts[:2] == ["gpuaas", "node"] and parts[3] == "report":
        return parts[2]
    return None


async def wipe_reported(
    repos: EvidenceRepositories, events: EventCollector | OutboxWriter, subject: str, ev: m.NodeSlotWipeReported
) -> dict[str, int]:
    """Judge each slot of the report's task; counts of slots freed, blocked, kept and of outcomes ignored."""
    sender = subject_node(subject)
    if sender != ev.node_id:
        # The subject is the sender's identity (a host may publish only its own): a body naming another node is
        # a forgery or a bug, and frees nothing.
        raise PermanentError(
            "foreign_wipe_report", f"a wipe report for {ev.node_id} arrived on {subject}: taken only from its own host"
        )
    if not await repos.wipes.lock_node(ev.node_id):
        raise PermanentError("unknown_node", f"no node {ev.node_id}")
    asks = await repos.wipes.open_asks_of_task(ev.node_id, ev.task_id)
    outcomes = {o.slot_id: o for o in ev.outcomes}
    counts = {"freed": 0, "blocked": 0, "kept": 0, "ignored": len(set(outcomes) - {a["slot_id"] for a in asks})}
    actor = f"node:{ev.node_id}"
    for ask in asks:
        counts[await _judge(repos.wipes, ev.task_id, ask, outcomes.get(ask["slot_id"]), actor)] += 1
    if asks:
        await repos.nodes.refresh([ev.node_id])
        await announce(events, await repos.slots.announcement(ev.node_id, "wipe", actor))
    log.info("slot_wipe_reported", node_id=ev.node_id, task_id=ev.task_id, **counts)
    return counts


async def _judge(
    wipes: SlotWipes, task_id: str, slot: dict[str, Any], outcome: m.SlotWipeOutcome | None, actor: str
) -> str:
    """One asked slot judged against the site's policy, its ask closed and the slot moved as the judgement says:
    'freed', 'blocked' or 'kept'."""
    reported = outcome.model_dump(mode="json") if outcome else {"device": slot["device"], "proof": None}
    if outcome is None:
        reported |= {"reason_code": "not_reported", "reason": "the host's report names no outcome for this slot"}
    problems = binding_problems(slot)
    if slot["claimed"]:
        problems.append("a live claim holds the slot")
    judgement = judge_wipe(slot, slot["device"], reported, problems)
    passed = "passed" if judgement.passed else "failed"
    await wipes.close(task_id, slot["slot_id"], outcome=passed, verdict=judgement.verdict, report=reported)
    if judgement.to is None:
        return "kept"
    freed = judgement.to == "available"
    await wipes.move_slot(
        slot["slot_id"],
        judgement.to,
        None if freed else judgement.verdict[:500],
        actor=actor,
        only_from=[slot["status"]],
        detail={"wipe_task": task_id, "cause": slot["cause"], "verdict": judgement.verdict, **reported},
        health=("healthy", judgement.verdict[:500]) if freed else None,
    )
    return "freed" if freed else "blocked"
