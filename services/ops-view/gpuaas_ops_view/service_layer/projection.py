"""One stream message in, the read models' rows out: the handler of each message type, run in the follower's
transaction (`entrypoints/follow.py`). A message that breaks the contract, or that the models cannot fit into
what they hold, raises PermanentError: the follower dead-letters it with the reason and goes on."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from gpuaas_common.bus import PermanentError, parse_message
from gpuaas_common.contract import AllocationState, Envelope, TaskType, derived_event_id
from gpuaas_common.contract import messages as m

from ..domain.models import (
    claim_outcome,
    failing_checks,
    maas_status,
    place_announcement,
    place_transition,
    task_status,
    wipe_outcomes_text,
)
from ..domain.usage import ENDS, usage_of
from .ports import BatchProjection, Projection


@dataclass(frozen=True)
class Message:
    """A stream message as the follower read it."""

    stream: str
    seq: int
    subject: str
    data: bytes


@dataclass
class Event:
    envelope: Envelope
    payload: dict[str, Any]
    message: Message

    @property
    def at(self) -> datetime:
        return self.envelope.occurred_at


Handler = Callable[[Projection, Event], Awaitable[None]]


async def apply(repo: Projection, message: Message) -> None:
    """Apply one message; PermanentError when it cannot be placed (nothing written for it)."""
    handled = _handled(message)
    if handled is not None:
        await handled[0](repo, handled[1])


async def apply_batch(repo: BatchProjection, messages: Sequence[Message]) -> None:
    """Apply a batch's messages in stream order, as `apply` would one after another, reading what their
    allocations and node tasks need once and writing at the end (adapters/projection.py's BatchProjection);
    PermanentError at the first that cannot be placed, and the caller's transaction must then go: what was
    written so far is incomplete."""
    handled = [h for h in map(_handled, messages) if h is not None]
    await repo.load(
        {ev.payload["allocation_id"] for handler, ev in handled if handler in _READS_ALLOCATION},
        {ev.payload["task_id"] for handler, ev in handled if handler in _READS_TASK},
    )
    for handler, ev in handled:
        await handler(repo, ev)
    await repo.flush()


def _handled(message: Message) -> tuple[Handler, Event] | None:
    """The message's handler and event; None when the models keep nothing of its type."""
    envelope, payload = parse_message(message.subject, message.data)
    handler = HANDLERS.get(envelope.type)
    if handler is None:
        return None
    return handler, Event(envelope, payload.model_dump(mode="python"), message)


# --- allocations ---------------------------------------------------------------------------------------


async def on_lifecycle(repo: Projection, ev: Event) -> None:
    p = ev.payload
    known = await repo.timeline_states(p["allocation_id"])
    placement = place_transition(known, p["seq"], p["state"])
    if placement == "repeat":
        return
    if placement == "conflict":
        raise PermanentError(
            "unplaceable",
            f"allocation {p['allocation_id']} already has {known[p['seq']]!r} at seq {p['seq']}, not {p['state']!r}",
        )
    detail = {k: v for k, v in p.items() if k in _TIMELINE_DETAIL}
    await repo.add_transition(
        p["allocation_id"], p["seq"], p["state"], p.get("previous_state"), ev.envelope.event_id, ev.at, detail
    )
    await repo.upsert_allocation(_allocation_row(p, ev.at), newest=placement == "newer")
    if p["state"] == "placed":
        await repo.place_claims(p["allocation_id"], p["node_id"], p["claim_mode"], p.get("slots", []), ev.at)
    outcome = claim_outcome(p["state"], p)
    if outcome is not None:
        await repo.end_claims(p["allocation_id"], outcome, ev.at)
    if p["state"] in _USAGE_STATES:
        await record_usage(repo, p["allocation_id"], ev.envelope.event_id)


# The states a usage record is made of (active, its end) or takes facts from (accepted: SKU and GPU count).
_USAGE_STATES = (AllocationState.ACCEPTED, AllocationState.ACTIVE, *ENDS)


async def record_usage(repo: Projection, allocation_id: Any, cause: str) -> None:
    """The allocation's usage record, as its timeline now makes it (domain/usage.py). When this event closed
    it, `usage.recorded` goes out through the outbox in the same transaction, under an id derived from the
    allocation: a replay, a redelivery or a rebuild closes no record a second time, and a rebuild's copy of the
    event is the same event (JetStream drops it within its duplicate window, a consumer's inbox after)."""
    usage = usage_of(await repo.moves(allocation_id))
    if usage is None:
        return
    was_closed = await repo.usage_closed(allocation_id)
    facts = await repo.allocation_facts(allocation_id)
    await repo.put_usage(allocation_id, usage, facts)
    if not usage.closed or was_closed:
        return
    assert usage.stopped_at is not None and usage.seconds is not None and usage.ended is not None
    record = m.UsageRecorded(
        allocation_id=allocation_id,
        tenant_id=facts["tenant_id"],
        shape=facts["shape"],
        sku=facts.get("sku"),
        gpu_count=facts.get("gpu_count"),
        region=facts.get("region"),
        node_id=facts.get("node_id"),
        started_at=usage.started_at,
        stopped_at=usage.stopped_at,
        seconds=usage.seconds,
        ended=usage.ended,
        end_reason_code=usage.end_reason_code,
    )
    await repo.publish(
        "usage.recorded",
        record,
        aggregate_id=str(allocation_id),
        event_id=derived_event_id(str(allocation_id), "usage.recorded"),
        causation_id=cause,
    )


# What of each lifecycle event the timeline keeps (the rest is on the allocation's row).
_TIMELINE_DETAIL = (
    "node_id",
    "claim_mode",
    "task_id",
    "operation_id",
    "reason_code",
    "reason",
    "filtered",
    "free_gpus",
    "requested_gpus",
    "cleanup",
    "cleanup_required",
    "wipe_proofs",
    "maas_system_id",
    "machine_erase",
)


def _allocation_row(p: dict[str, Any], at: datetime) -> dict[str, Any]:
    image = p.get("image")
    row = {
        "allocation_id": p["allocation_id"],
        "tenant_id": p.get("tenant_id") or "",
        "shape": p.get("shape") or "",
        "state": p["state"],
        "seq": p["seq"],
        "sku": p.get("sku"),
        "gpu_count": p.get("gpu_count"),
        "region": p.get("region"),
        "image": image["slug"] if isinstance(image, dict) else image,
        "node_id": p.get("node_id"),
        "claim_mode": p.get("claim_mode"),
        "reason_code": p.get("reason_code"),
        "reason": p.get("reason"),
        "access": p.get("access"),
        "created_at": at,
        "updated_at": at,
    }
    if p["state"] == "unschedulable":
        row["why_not"] = {k: p[k] for k in ("filtered", "free_gpus", "requested_gpus")}
    return row


async def on_rejected(repo: Projection, ev: Event) -> None:
    p = ev.payload
    row = {**_allocation_row({**p, "state": "rejected", "seq": 0}, ev.at)}
    await repo.upsert_allocation(row, newest=False)


async def on_force_released(repo: Projection, ev: Event) -> None:
    await repo.forced_release(ev.payload["allocation_id"], ev.payload, ev.at)


# --- node tasks ----------------------------------------------------------------------------------------


async def on_task_sent(repo: Projection, ev: Event) -> None:
    p = ev.payload
    current = await repo.task_status(p["task_id"])
    await repo.upsert_task(
        {
            "task_id": p["task_id"],
            "allocation_id": p.get("allocation_id"),
            "node_id": p["node_id"],
            "task_type": ev.envelope.type,
            "sent_at": ev.at,
            "deadline": p.get("deadline"),
            "status": task_status(current, "queued"),
            "updated_at": ev.at,
        }
    )


async def on_task_progress(repo: Projection, ev: Event) -> None:
    p = ev.payload
    current = await repo.task_status(p["task_id"])
    await repo.upsert_task(
        {
            "task_id": p["task_id"],
            "allocation_id": p["allocation_id"],
            "node_id": p["node_id"],
            "task_type": p["task_type"],
            "status": task_status(current, "running"),
            "updated_at": ev.at,
        }
    )
    await repo.add_phase(p["task_id"], p["node_id"], ev.message.seq, p["phase"], p.get("detail"), ev.at)


async def on_task_result(repo: Projection, ev: Event) -> None:
    p = ev.payload
    current = await repo.task_status(p["task_id"])
    await repo.upsert_task(
        {
            "task_id": p["task_id"],
            "allocation_id": p["allocation_id"],
            "node_id": p["node_id"],
            "task_type": p["task_type"],
            "status": task_status(current, p["status"]),
            "reason_code": p.get("reason_code"),
            "reason": p.get("reason"),
            "finished_at": ev.at,
            "updated_at": ev.at,
        }
    )


async def on_slot_wipe_reported(repo: Projection, ev: Event) -> None:
    """A host's answer to a slice.slot_wipe (no allocation's task: the host's own timeline): the task finishes,
    succeeded only when every slot's disk was proven wiped, and its phase names each slot's outcome (device, method,
    verified, or why not) as ops read it beside the scheduler's verdict."""
    p = ev.payload
    current = await repo.task_status(p["task_id"])
    outcomes = p["outcomes"]
    unproven = [o["slot_id"] for o in outcomes if not (o.get("proof") and o["proof"]["verified"])]
    await repo.upsert_task(
        {
            "task_id": p["task_id"],
            "allocation_id": None,
            "node_id": p["node_id"],
            "task_type": TaskType.SLICE_SLOT_WIPE,
            "status": task_status(current, "failed" if unproven else "succeeded"),
            "reason_code": "wipe_not_proven" if unproven else None,
            "reason": ("no verified proof for " + ", ".join(unproven))[:2000] if unproven else None,
            "finished_at": ev.at,
            "updated_at": ev.at,
        }
    )
    await repo.add_phase(
        p["task_id"], p["node_id"], ev.message.seq, "wipe_reported", wipe_outcomes_text(outcomes), ev.at
    )


# --- fleet ---------------------------------------------------------------------------------------------


async def on_enrolled(repo: Projection, ev: Event) -> None:
    p = ev.payload
    await repo.host_evidence(
        p["node_id"],
        ev.at,
        kind=p["kind"],
        hostname=p["hostname"],
        agent_version=p["agent_version"],
        maas_system_id=p.get("maas_system_id"),
        enrolled_at=ev.at,
    )


async def on_host_mode(repo: Projection, ev: Event) -> None:
    p = ev.payload
    await repo.host_mode(
        ev.envelope.event_id, p["node_id"], p["from_mode"], p["to_mode"], p["actor"], p["reason"], p["changed_at"]
    )


async def on_slots_changed(repo: Projection, ev: Event) -> None:
    """A host's slots as the scheduler announced them: the newest announcement of the host replaces what the
    model holds of each slot it lists (one never placed is added); an older one, read after it, and a repeat change
    nothing."""
    p = ev.payload
    known = await repo.slots_announced(p["node_id"])
    placement = place_announcement(known, p["generation"], ev.envelope.event_id)
    if placement == "conflict":
        assert known is not None
        raise PermanentError(
            "unplaceable",
            f"host {p['node_id']} already has announcement {p['generation']} from event {known[1]}, "
            f"not {ev.envelope.event_id}",
        )
    if placement == "newer":
        await repo.announce_slots(p["node_id"], p["generation"], ev.envelope.event_id, p["slots"], ev.at)


async def on_parity(repo: Projection, ev: Event) -> None:
    p = ev.payload
    await repo.host_evidence(
        p["node_id"],
        ev.at,
        parity_profile=p["profile"],
        parity_failures=p["failures"],
        parity_warnings=p["warnings"],
        parity_failing=failing_checks(p["checks"]),
        parity_checked_at=p["checked_at"],
    )


async def on_topology(repo: Projection, ev: Event) -> None:
    p = ev.payload
    await repo.host_evidence(
        p["node_id"],
        ev.at,
        topology_gpus=len(p["gpus"]),
        topology_candidates=len(p["candidate_slots"]),
        topology_blockers=p["blockers"],
        topology_at=p["discovered_at"],
    )


async def on_drift(repo: Projection, ev: Event) -> None:
    p = ev.payload
    drift = [{k: d[k] for k in ("kind", "subject", "detail", "slot_ids", "swept")} for d in p["drift"]]
    await repo.host_evidence(p["node_id"], ev.at, drift=drift, drift_checked_at=p["checked_at"])


# --- images --------------------------------------------------------------------------------------------


async def on_image_published(repo: Projection, ev: Event) -> None:
    p = ev.payload
    await repo.image(p["slug"], "published", ev.at, digest_sha256=p["digest_sha256"], build_id=p["build_id"])


async def on_image_activated(repo: Projection, ev: Event) -> None:
    p = ev.payload
    await repo.image(p["slug"], "active", ev.at, digest_sha256=p["digest_sha256"], kind=p["kind"], sku=p["sku"])


async def on_image_deactivated(repo: Projection, ev: Event) -> None:
    await repo.image(ev.payload["slug"], "disabled", ev.at, reason=ev.payload["reason"])


async def on_image_build(repo: Projection, ev: Event) -> None:
    await repo.image(ev.payload["slug"], None, ev.at, build_id=ev.payload["build_id"])


async def on_image_cache(repo: Projection, ev: Event) -> None:
    await repo.image_cache(ev.payload, ev.at)


# --- MAAS ----------------------------------------------------------------------------------------------


def _op(subject: str) -> str:
    return subject.rsplit(".", 1)[-1]


async def on_maas_command(repo: Projection, ev: Event) -> None:
    p = ev.payload
    current = await repo.maas_status(p["operation_id"])
    await repo.upsert_maas(
        {
            "operation_id": p["operation_id"],
            "op": _op(ev.message.subject),
            "allocation_id": p.get("allocation_id"),
            "node_id": p.get("node_id"),
            "system_id": p.get("system_id"),
            "status": maas_status(current, "requested"),
            "erase_mode": p.get("erase_mode"),
            "requested_at": ev.at,
            "updated_at": ev.at,
        }
    )


async def on_maas_result(repo: Projection, ev: Event) -> None:
    p = ev.payload
    current = await repo.maas_status(p["operation_id"])
    await repo.upsert_maas(
        {
            "operation_id": p["operation_id"],
            "op": _op(ev.message.subject),
            "allocation_id": p.get("allocation_id"),
            "node_id": p.get("node_id"),
            "system_id": p.get("system_id"),
            "status": maas_status(current, p["status"]),
            "resolution": p.get("resolution"),
            "reason_code": p.get("reason_code"),
            "status_message": p.get("status_message"),
            "attempts": p.get("attempts"),
            # A release's erase (None for the other operations): the mode applied and what MAAS showed of it.
            "erase_mode": p.get("erase_mode"),
            "erase_outcome": p.get("erase_outcome"),
            "resolved_at": ev.at,
            "updated_at": ev.at,
        }
    )


# --- audit ---------------------------------------------------------------------------------------------


async def on_admin_request(repo: Projection, ev: Event) -> None:
    await repo.audit(ev.envelope.event_id, ev.payload, ev.at)


# --- dead letters --------------------------------------------------------------------------------------


async def on_dead_letter(repo: Projection, ev: Event) -> None:
    await repo.dead_letter(ev.message.seq, ev.message.subject, ev.payload, ev.at)


# Every state a lifecycle event carries (`requested` never leaves the allocator).
_LIFECYCLE = tuple(s for s in AllocationState if s != AllocationState.REQUESTED)
HANDLERS: dict[str, Handler] = {
    **{f"allocation.{state}": on_lifecycle for state in _LIFECYCLE},
    "allocation.rejected": on_rejected,
    "placement.force_released": on_force_released,
    TaskType.SLICE_VM_PROVISION: on_task_sent,
    TaskType.SLICE_VM_RELEASE: on_task_sent,
    TaskType.SLICE_TOPOLOGY_DISCOVER: on_task_sent,
    TaskType.IMAGE_CACHE_PREWARM: on_task_sent,
    TaskType.SLICE_SLOT_WIPE: on_task_sent,
    "node.slot_wipe_reported": on_slot_wipe_reported,
    "node.task_progress": on_task_progress,
    "node.task_result": on_task_result,
    "node.enrolled": on_enrolled,
    "node.parity_reported": on_parity,
    "node.topology_reported": on_topology,
    "node.drift_reported": on_drift,
    "image.published": on_image_published,
    "image.activated": on_image_activated,
    "image.deactivated": on_image_deactivated,
    "image.build_progress": on_image_build,
    "image.node_cache_changed": on_image_cache,
    "maas.deploy_requested": on_maas_command,
    "maas.release_requested": on_maas_command,
    "maas.commission_requested": on_maas_command,
    "maas.deploy_result": on_maas_result,
    "maas.release_result": on_maas_result,
    "maas.commission_result": on_maas_result,
    "dead_letter": on_dead_letter,
    "scheduler.admin_request_recorded": on_admin_request,
    "scheduler.host_mode_changed": on_host_mode,
    "scheduler.slots_changed": on_slots_changed,
    "image.admin_request_recorded": on_admin_request,
}
# The handlers that read or write an allocation's rows: a batch reads what it needs of all theirs at once.
_READS_ALLOCATION = (on_lifecycle, on_rejected)
# And those that read a node task's.
_READS_TASK = (on_task_sent, on_task_progress, on_task_result, on_slot_wipe_reported)
