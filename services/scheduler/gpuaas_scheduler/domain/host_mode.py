"""Host mode: which shape of capacity a host serves, as a state machine the scheduler owns. Pure: no I/O.

A host is in exactly one mode:

- `slice`      — serves slices from its approved slots; never handed out whole;
- `baremetal`  — serves whole-host allocations only; it holds no approved slots (all retired);
- `converting` — back from a MAAS deployment (or being re-commissioned): its slice bootstrap, parity and
                 topology are unknown, so it serves nothing until it is rediscovered, passes parity and
                 ops re-approve its slots;
- `drained`    — a slice host taking nothing new: live slices run to their end, and from here it may be
                 converted to baremetal or retired;
- `retired`    — out of the fleet.

Why the guards (runbooks: slice-node-bootstrap "This host is now in slice mode. Do not remount /share* or
use these NVMe devices for baremetal/share workloads while any slice slots are available, reserved,
provisioning, active, releasing, or cleanup"; "Persistent VFIO binding: apply only after the node is
intentionally in slice mode"; slice-implementation-checklist "Freeing a sliced node for baremetal is v1
drain/natural release"): a baremetal tenant owns every disk and GPU of the host, so no slot may still
promise them to slices; and a MAAS deployment replaces the host's OS, so nothing learnt about it before
(parity, topology, approved slots) describes it afterwards.

The aggregate (`Host`) checks a requested change against the table and records it with who, why and
when; the adapter persists the recorded changes and their history.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import datetime

from gpuaas_common.contract import HostMode

SLICE, BAREMETAL, CONVERTING, DRAINED, RETIRED = (
    HostMode.SLICE,
    HostMode.BAREMETAL,
    HostMode.CONVERTING,
    HostMode.DRAINED,
    HostMode.RETIRED,
)
MODES = tuple(HostMode)


@dataclass(frozen=True)
class HostFacts:
    """What the guards look at, read under the node's row lock."""

    node_id: str
    mode: str
    accepts_slices: bool = False  # MAAS tag gpuaas-profile-slice-vm
    accepts_baremetal: bool = False  # MAAS tag gpuaas-profile-baremetal
    live_claims: int = 0
    # Approved slots in any status but `retired`: each still promises a GPU and a disk to slices.
    unretired_slots: int = 0
    parity_failures: int | None = None
    # A topology report was applied since the evidence was last reset (the reset clears it, and
    # reports older than the reset are refused as stale).
    rediscovered: bool = False
    # Slots `available` or `awaiting_wipe` (placed nowhere until the host proves their wipe) whose approval is
    # newer than the last evidence reset.
    reapproved_slots: int = 0
    # Unretired slots approved before the last reset: they describe the host as it was before.
    stale_slots: int = 0


Guard = Callable[[HostFacts], "str | None"]


def no_live_claims(h: HostFacts) -> str | None:
    return (
        None
        if h.live_claims == 0
        else (f"{h.live_claims} live claim(s) on the host: wait for their allocations to be released")
    )


def slots_retired(h: HostFacts) -> str | None:
    return (
        None
        if h.unretired_slots == 0
        else (
            f"{h.unretired_slots} approved slot(s) not retired: retire them first "
            "(POST /v1/nodes/{node_id}/slots/retire); a cleanup_blocked slot needs a verified wipe first"
        )
    )


def baremetal_profile(h: HostFacts) -> str | None:
    return None if h.accepts_baremetal else "the host lacks the MAAS tag gpuaas-profile-baremetal"


def slice_profile(h: HostFacts) -> str | None:
    return None if h.accepts_slices else "the host lacks the MAAS tag gpuaas-profile-slice-vm"


def parity_passed(h: HostFacts) -> str | None:
    if h.parity_failures is None:
        return "no parity run reported since the host's evidence was reset"
    return None if h.parity_failures == 0 else f"the last parity run reported {h.parity_failures} failure(s)"


def rediscovered(h: HostFacts) -> str | None:
    return None if h.rediscovered else "no topology report since the host's evidence was reset (run discovery)"


def reapproved(h: HostFacts) -> str | None:
    return None if h.reapproved_slots > 0 else "no slot re-approved since the host's evidence was reset"


def no_stale_slots(h: HostFacts) -> str | None:
    return (
        None
        if h.stale_slots == 0
        else (f"{h.stale_slots} slot(s) were approved before the evidence reset: re-approve or retire them")
    )


# (from, to) -> guards; every pair not listed is refused. Entering `converting` resets the evidence.
TRANSITIONS: dict[tuple[str, str], tuple[Guard, ...]] = {
    (SLICE, DRAINED): (),
    (DRAINED, SLICE): (slice_profile, parity_passed),
    (DRAINED, BAREMETAL): (no_live_claims, slots_retired, baremetal_profile),
    (DRAINED, CONVERTING): (no_live_claims, slots_retired, slice_profile),
    (DRAINED, RETIRED): (no_live_claims, slots_retired),
    (BAREMETAL, CONVERTING): (no_live_claims, slots_retired, slice_profile),
    (BAREMETAL, RETIRED): (no_live_claims, slots_retired),
    (CONVERTING, SLICE): (slice_profile, rediscovered, parity_passed, reapproved, no_stale_slots),
    (CONVERTING, BAREMETAL): (no_live_claims, slots_retired, baremetal_profile),
    (CONVERTING, RETIRED): (no_live_claims, slots_retired),
    (RETIRED, CONVERTING): (no_live_claims, slots_retired, slice_profile),
    (RETIRED, BAREMETAL): (no_live_claims, slots_retired, baremetal_profile),
}
RESETS_EVIDENCE = frozenset({CONVERTING})

# Why a tempting shortcut is not a transition, and the path that is.
_DETOURS = {
    (SLICE, BAREMETAL): "drain it first: slice → drained → baremetal, once its live claims are released and "
    "its slots retired",
    (SLICE, RETIRED): "drain it first: slice → drained → retired",
    (SLICE, CONVERTING): "drain it first: slice → drained → converting",
    (BAREMETAL, SLICE): "a host back from baremetal goes through converting: rediscovery, a passing parity run "
    "and re-approval of its slots",
    (BAREMETAL, DRAINED): "a baremetal host leaves through converting or retired; use drain/maintenance to stop "
    "placements on it",
    (CONVERTING, DRAINED): "a converting host becomes a slice host only through rediscovery, parity and re-approval",
    (RETIRED, SLICE): "a retired host returns through converting",
    (RETIRED, DRAINED): "a retired host returns through converting",
}


def allowed_targets(mode: str) -> list[str]:
    return [to for (frm, to) in TRANSITIONS if frm == mode]


def transition_problems(facts: HostFacts, target: str) -> list[str]:
    """Every reason `facts.mode → target` is refused now; empty when it is allowed."""
    if target not in MODES:
        return [f"unknown mode {target!r}; modes: {', '.join(MODES)}"]
    if target == facts.mode:
        return [f"the host is already {target}"]
    guards = TRANSITIONS.get((facts.mode, target))
    if guards is None:
        hint = _DETOURS.get((facts.mode, target))
        allowed = ", ".join(allowed_targets(facts.mode)) or "nothing"
        return [
            f"{facts.mode} → {target} is not a transition"
            + (f": {hint}" if hint else "")
            + f" (from {facts.mode}: {allowed})"
        ]
    return [p for p in (g(facts) for g in guards) if p is not None]


def changed(facts: HostFacts, target: str) -> HostFacts:
    """The facts after an allowed change to `target`."""
    after = replace(facts, mode=target)
    if target in RESETS_EVIDENCE:
        # Unknown, not failed: the evidence has to be gathered again.
        after = replace(
            after, parity_failures=None, rediscovered=False, reapproved_slots=0, stale_slots=after.unretired_slots
        )
    return after


@dataclass(frozen=True)
class ModeChange:
    node_id: str
    from_mode: str
    to_mode: str
    actor: str
    reason: str
    at: datetime
    resets_evidence: bool
    allocation_id: str | None = None


class ModeRefused(Exception):
    def __init__(self, node_id: str, current: str, target: str, problems: list[str]) -> None:
        super().__init__(f"{node_id}: {current} → {target} refused: {'; '.join(problems)}")
        self.node_id, self.current, self.target, self.problems = node_id, current, target, problems


class Host:
    """One host's mode and the facts its guards read; `changes` are those made in this unit of work."""

    def __init__(self, facts: HostFacts) -> None:
        self.facts = facts
        self.changes: list[ModeChange] = []

    @property
    def mode(self) -> str:
        return self.facts.mode

    def blockers(self, target: str) -> list[str]:
        return transition_problems(self.facts, target)

    def change_mode(
        self, target: str, *, actor: str, reason: str, at: datetime, allocation_id: str | None = None
    ) -> ModeChange:
        problems = self.blockers(target)
        if problems:
            raise ModeRefused(self.facts.node_id, self.facts.mode, target, problems)
        resets = target in RESETS_EVIDENCE
        change = ModeChange(self.facts.node_id, self.facts.mode, target, actor, reason, at, resets, allocation_id)
        self.facts = changed(self.facts, target)
        self.changes.append(change)
        return change

    def return_from_baremetal(
        self, *, actor: str, reason: str, at: datetime, allocation_id: str | None = None
    ) -> ModeChange | None:
        """After a baremetal allocation is released. MAAS redeployed the host, so its slice bootstrap
        is gone: a slice-capable host goes to `converting`. A baremetal-only host has nothing to
        convert to and stays in the baremetal pool (None)."""
        if self.facts.mode != BAREMETAL or not self.facts.accepts_slices:
            return None
        return self.change_mode(CONVERTING, actor=actor, reason=reason, at=at, allocation_id=allocation_id)

    def promotable_to_slice(self) -> bool:
        return self.facts.mode == CONVERTING and not self.blockers(SLICE)
