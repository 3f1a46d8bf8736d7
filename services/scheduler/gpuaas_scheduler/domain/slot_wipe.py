"""Every disk that changes tenant is proven clean by its own host (invariant 12). Pure: no I/O.

The rules, written as functions of one host's facts so that the Host aggregate (domain/host.py) applies them in
its methods (`Host.undrain` asks `wipe_on_return` of each slot; approval's `wipe_owed` and a report's `judge_wipe`
join it as `Host.approve` and `Host.wipe_reported` move there):

- **When a wipe is owed** (`WIPE_OWED_RULES`, a table): approval never makes a slot `available` when its disk may
  hold someone else's data: the host is `converting` (back from a baremetal tenancy, or redeployed by MAAS), the
  slot was `retired` (its disk left slice service, a baremetal tenant may have had it), it still awaits a wipe,
  or its disk is another one than the slot had (a new disk's past is unknown). Such a slot is `awaiting_wipe`,
  placed nowhere, and the scheduler asks its host's agent for the site's wipe (`slice.slot_wipe`).
- **A host back from maintenance** (`MAINTENANCE_RETURN_RULES`, a table): a technician may have swapped or
  touched any of its disks, so its undrain moves each unclaimed `available` slot to `awaiting_wipe` and asks the
  host to wipe it; a `disabled` or still-awaiting slot is asked again where it is (an earlier proof predates the
  maintenance). In-use slots are wiped at their release, retired and blocked ones at their re-approval or repair.
- **An ask past its deadline** (`reasked_when_overdue`): an awaiting or disabled slot is asked again (the old ask
  closed `expired`), so a lost task never waits for an operator.
- **What a host's wipe report makes of a slot** (`judge_wipe`): only an outcome that answers a wipe this
  scheduler asked of that very host, for that slot's disk, and that passes the site's policy (approval.py
  `wipe_verdict`) frees it. Anything else leaves it `cleanup_blocked` (an `awaiting_wipe` slot whose wipe failed
  may hold data). A proof typed by a person is no input here at all: the report arrives on the host's own report
  subject, which only that host's identity may publish.

Runbooks: "every slot disk wiped and verified before reuse"; "Tenant isolation wipe policy: blkdiscard, nvme
format, or site-specific secure erase path before any released slot can be reused".
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from gpuaas_common.contract import HostMode, SlotStatus

from .approval import wipe_verdict
from .slots import IN_USE

AWAITING_WIPE = SlotStatus.AWAITING_WIPE
CONVERTING = HostMode.CONVERTING


@dataclass(frozen=True)
class DiskFacts:
    """What approval knows about one slot's disk: the host's mode, the slot's status and disk before this approval
    (None: the approval creates the slot), the disk it approves now, and whether a wipe is still open for it."""

    host_mode: str
    previous_status: str | None
    previous_disk: str | None
    disk: str | None
    wipe_open: bool = False


@dataclass(frozen=True)
class WipeRule:
    name: str
    why: str
    owed: Callable[[DiskFacts], bool]


WIPE_OWED_RULES: tuple[WipeRule, ...] = (
    WipeRule(
        "host_converting",
        "the host is converting (back from a baremetal tenancy or a MAAS redeploy): a tenant may have written "
        "every disk",
        lambda f: f.host_mode == CONVERTING,
    ),
    WipeRule(
        "slot_retired",
        "the slot was retired: its disk left slice service and may hold a baremetal tenant's data",
        lambda f: f.previous_status == SlotStatus.RETIRED,
    ),
    WipeRule(
        "wipe_still_owed",
        "the slot still awaits its host's wipe proof",
        lambda f: f.previous_status == AWAITING_WIPE or f.wipe_open,
    ),
    WipeRule(
        "disk_changed",
        "the slot's disk is not the one it had: the new disk's past is unknown",
        lambda f: f.previous_status is not None and f.previous_disk != f.disk,
    ),
)


def wipe_owed(facts: DiskFacts) -> list[str]:
    """Why this slot's disk must be proven wiped by its host before the slot is placeable (empty: it need not)."""
    return [r.why for r in WIPE_OWED_RULES if r.owed(facts)]


def approval_status(problems: list[str], owed: list[str]) -> tuple[str, str | None]:
    """What approval makes of a candidate: `disabled` with every problem, else `awaiting_wipe` when a wipe is owed,
    else `available`."""
    if problems:
        return "disabled", "; ".join(problems)[:2000]
    if owed:
        return AWAITING_WIPE, ("awaiting the host agent's wipe proof: " + "; ".join(owed))[:2000]
    return "available", None


# --- a host back from maintenance ---------------------------------------------------------------------------


@dataclass(frozen=True)
class ReturnFacts:
    """One slot of a host whose maintenance ends (its undrain): its status, whether a live claim holds it and
    whether a wipe ask is open for it."""

    status: str
    claimed: bool
    wipe_open: bool = False


@dataclass(frozen=True)
class ReturnRule:
    name: str
    applies: Callable[[ReturnFacts], bool]
    # Ask the host's wipe of the slot's disk; the status it moves to meanwhile (None: it stays).
    ask: bool
    to: str | None
    why: str


@dataclass(frozen=True)
class ReturnWipe:
    rule: str
    ask: bool
    to: str | None
    why: str


# A technician may have swapped or touched any disk during maintenance, so no slot is placeable again before its
# host proves the site's wipe of the disk it has now. First rule that applies wins.
MAINTENANCE_RETURN_RULES: tuple[ReturnRule, ...] = (
    ReturnRule(
        "in_use",
        lambda f: f.claimed or f.status in IN_USE,
        False,
        None,
        "in use: its release's cleanup proves the wipe before it is placed again",
    ),
    ReturnRule(
        "retired",
        lambda f: f.status == SlotStatus.RETIRED,
        False,
        None,
        "retired: its re-approval owes the wipe (slot_retired)",
    ),
    ReturnRule(
        "available",
        lambda f: f.status == SlotStatus.AVAILABLE,
        True,
        AWAITING_WIPE,
        "back from maintenance: its disk may have been swapped or touched",
    ),
    ReturnRule(
        "disabled",
        lambda f: f.status == SlotStatus.DISABLED,
        True,
        None,
        "back from maintenance: its disk may have been swapped or touched; a repair waits for the proof",
    ),
    ReturnRule(
        "awaiting_wipe",
        lambda f: f.status == AWAITING_WIPE,
        True,
        None,
        "back from maintenance: a wipe done before it says nothing of the disk now, so the host is asked again",
    ),
    ReturnRule(
        "blocked_wipe_open",
        lambda f: f.status == SlotStatus.CLEANUP_BLOCKED and f.wipe_open,
        True,
        None,
        "back from maintenance: a wipe done before it says nothing of the disk now, so the host is asked again",
    ),
    ReturnRule(
        "blocked",
        lambda f: f.status == SlotStatus.CLEANUP_BLOCKED,
        False,
        None,
        "cleanup_blocked: its repair asks the host's wipe",
    ),
)


def wipe_on_return(facts: ReturnFacts) -> ReturnWipe:
    """What a host's return from maintenance makes of one slot: whether its disk owes a wipe proof and where the
    slot waits for it. A status no rule names is left alone (and is a gap the unit test catches)."""
    for r in MAINTENANCE_RETURN_RULES:
        if r.applies(facts):
            return ReturnWipe(r.name, r.ask, r.to, r.why)
    return ReturnWipe("none", False, None, f"no rule for a {facts.status} slot")


# --- an ask past its deadline ------------------------------------------------------------------------------

# Where an open ask is the slot's only way back, so a lost one (the host down past the task's deadline, the task
# dropped as stale) is asked again by the scheduler itself rather than left to an operator: an awaiting slot
# waits for nothing else, and a disabled one's repair is refused while its wipe is owed. A blocked slot's repair
# asks again anyway; a claimed slot is its release's business.
REASKED_WHEN_OVERDUE = frozenset({AWAITING_WIPE, SlotStatus.DISABLED})


def reasked_when_overdue(status: str, claimed: bool) -> bool:
    """Whether a slot whose open wipe ask passed its deadline unanswered is asked again."""
    return not claimed and status in REASKED_WHEN_OVERDUE


# The statuses a host's passing proof frees (to `available`); the slot's binding rules must still hold. A
# `disabled` slot's proof is recorded (it owes no wipe any more) but frees nothing: approval or repair decide it.
FREED_BY_PROOF = frozenset({AWAITING_WIPE, SlotStatus.CLEANUP_BLOCKED})


@dataclass(frozen=True)
class WipeJudgement:
    """`passed`: the host proved the site's wipe of the slot's disk; `to`: the slot's status after the report
    (None: left as it is); `verdict`: why, for the log."""

    passed: bool
    to: str | None
    verdict: str


def judge_wipe(
    slot: Mapping[str, Any],
    requested_device: str,
    outcome: Mapping[str, Any],
    binding_problems: list[str],
) -> WipeJudgement:
    """One slot's outcome of a wipe this scheduler asked of the slot's own host. `slot`: the slot now (status,
    nvme_by_id, destructive_wipe_policy, wipe_policy_site); `requested_device`: the disk the task named;
    `binding_problems`: what keeps the slot from placement besides its disk (a live claim included)."""
    status = slot.get("status")
    device = slot.get("nvme_by_id")
    failed_to = SlotStatus.CLEANUP_BLOCKED if status == AWAITING_WIPE else None
    if device != requested_device or outcome.get("device") != requested_device:
        # Re-approved onto another disk since the task was sent: the proof is of a disk the slot no longer has.
        return WipeJudgement(
            False, failed_to, f"the report is for {outcome.get('device')}; the slot's disk is {device}"
        )
    proof = outcome.get("proof")
    if proof is None:
        why = f"{outcome.get('reason_code')}: {outcome.get('reason') or 'no reason given'}"
        return WipeJudgement(False, failed_to, f"the host did not wipe {device}: {why}")
    verdict = wipe_verdict(slot, [proof])
    if verdict is not None:
        return WipeJudgement(False, failed_to, verdict)
    proven = f"wipe of {device} by {proof.get('method')} proven by the host"
    if status not in FREED_BY_PROOF:
        return WipeJudgement(True, None, f"{proven}; the slot is {status}, which a wipe does not free")
    if binding_problems:
        # Wiped, but not a slot placement may use: it stays where it is, its disk clean.
        return WipeJudgement(True, None, f"{proven}; the slot still fails approval: " + "; ".join(binding_problems))
    return WipeJudgement(True, "available", proven)
