"""The rules of the read models: how an event changes what they say. Pure: no database, no bus.

Each stream is followed on its own, so events of one allocation or host arrive in stream order within a stream
but in any order across streams. Every rule here is therefore a merge that gives the same row whatever order
the streams were read in (a rebuild reads them one after another, the live follower side by side)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Literal

from gpuaas_common.contract import SlotStatus

Placement = Literal["newer", "older", "repeat", "conflict"]


def place_transition(known: dict[int, str], seq: int, state: str) -> Placement:
    """Where a lifecycle event goes in an allocation's timeline (`known`: seq -> state already there). The
    allocator numbers every transition, so one seq carrying two states is a broken history."""
    if seq in known:
        return "repeat" if known[seq] == state else "conflict"
    return "newer" if not known or seq > max(known) else "older"


def claim_outcome(state: str, payload: dict[str, Any]) -> str | None:
    """What an allocation's end left on its slots or node: `wiped` (verified cleanup), `cleanup_blocked` (ops must
    look: a failure that touched tenant data, a release without proof), `released` (nothing was touched); None
    while it holds them."""
    if state == "released":
        cleanup = payload.get("cleanup") or {}
        if not cleanup.get("required"):
            return "released"
        return "wiped" if cleanup.get("verified") else "cleanup_blocked"
    if state == "failed":
        return "cleanup_blocked" if payload.get("cleanup_required") else "released"
    if state == "unschedulable":
        return "released"
    return None


def slot_status(claims: list[dict[str, Any]]) -> str:
    """A slot as the bus last described it: `held` by a live claim, `cleanup_blocked` when its last claim ended
    without a wipe proof, else `available`. The scheduler is the judge; this is what its events said."""
    live = [c for c in claims if c.get("released_at") is None]
    if live:
        return "held"
    ended = sorted(claims, key=lambda c: c["released_at"])
    if ended and ended[-1].get("outcome") == "cleanup_blocked":
        return "cleanup_blocked"
    return "available"


# The statuses the scheduler gives a slot only while a claim holds it: an announcement made meanwhile says nothing
# of them that the lifecycle events (the claims) do not say better.
CLAIMED = (SlotStatus.RESERVED, SlotStatus.PROVISIONING, SlotStatus.ACTIVE, SlotStatus.RELEASING, SlotStatus.CLEANUP)


def slot_view_status(claims: list[dict[str, Any]], announced: str | None, announced_at: datetime | None) -> str:
    """A slot's status from both what the bus said of it: its claims (`slot_status`) and the scheduler's last
    announcement of its host's slots (`announced`, at `announced_at`; None when none named it). A live claim holds
    it. Otherwise the newer of the two speaks: the announcement when no claim of the slot ended after it (disabled,
    retired, blocked by a refused wipe, repaired: what no claim says; and a slot never placed has nothing else),
    the claims when their last end is newer (a release after the announcement gave it back or blocked it). An
    announced status of a claimed slot defers to the claims."""
    from_claims = slot_status(claims)
    if from_claims == "held" or announced is None or announced_at is None or announced in CLAIMED:
        return from_claims
    ends = [c["released_at"] for c in claims if c.get("released_at") is not None]
    return announced if not ends or announced_at >= max(ends) else from_claims


Announcement = Literal["newer", "older", "repeat", "conflict"]


def place_announcement(known: tuple[int, str] | None, generation: int, event_id: str) -> Announcement:
    """Where an announcement of a host's slots goes, against the newest read of that host (`known`: its number and
    event id; None before the first). The scheduler numbers a host's announcements one by one, so one number
    carried by two events is a broken history."""
    if known is None or generation > known[0]:
        return "newer"
    if generation < known[0]:
        return "older"
    return "repeat" if known[1] == event_id else "conflict"


TASK_FINAL = ("succeeded", "failed", "refused")


def task_status(current: str | None, incoming: str) -> str:
    """A task's status: a final result wins over progress and over the task being sent, whichever came first."""
    if current in TASK_FINAL:
        return current
    if incoming in TASK_FINAL or current is None:
        return incoming
    return "running" if incoming != "queued" else current


def wipe_outcome_text(outcome: dict[str, Any]) -> str:
    """One slot's outcome of a host's wipe, as ops read it on the host's timeline."""
    head = f"{outcome['slot_id']} {outcome['device']}: "
    proof = outcome.get("proof")
    if proof is None:
        reason = outcome.get("reason")
        return head + f"refused ({outcome.get('reason_code')})" + (f": {reason}" if reason else "")
    said = f"{proof['method']}, " + ("verified" if proof["verified"] else "NOT verified")
    if proof.get("signatures"):
        said += ", signatures remain: " + ", ".join(proof["signatures"])
    if not proof["verified"] and proof.get("detail"):
        said += f" ({proof['detail']})"
    return head + said


def wipe_outcomes_text(outcomes: list[dict[str, Any]]) -> str:
    return "; ".join(wipe_outcome_text(o) for o in outcomes)


def failing_checks(checks: list[dict[str, Any]]) -> list[dict[str, str]]:
    return [
        {"check": c["check"], "status": c["status"], "detail": c["detail"]} for c in checks if c["status"] != "PASS"
    ]


@dataclass(frozen=True)
class EvidenceAge:
    parity_s: float | None
    topology_s: float | None
    drift_s: float | None


def evidence_age(
    now: datetime, parity: datetime | None, topology: datetime | None, drift: datetime | None
) -> EvidenceAge:
    def age(at: datetime | None) -> float | None:
        return None if at is None else max((now - at) / timedelta(seconds=1), 0.0)

    return EvidenceAge(age(parity), age(topology), age(drift))


def maas_status(current: str | None, incoming: str) -> str:
    """An operation's status: its result wins over the command, whichever of the two was read first."""
    if current is not None and current != "requested":
        return current
    return incoming
