"""Host: one node, its slots and its mode, the consistency boundary of what ops and the host's own reports do to
it (issue 39). Pure: no I/O.

Loaded whole under the node's row lock (adapters/hosts.py), changed only through its methods, which check their
own rules and record what they did in `changes`; the repository writes what was recorded and the service layer
turns it into the unit of work's events (service_layer/hosts.py). So an admin action reads: parse, load, one
method, save.

The rules stay where they are written as tables and pure functions: the mode machine in host_mode.py, the
maintenance return in slot_wipe.py, the VFIO binding in vfio_binding.py. This aggregate applies them to one host.

The host's own reports (parity, topology, drift) are recorded through it too: each is taken only when newer than
the last one taken and than the host's last evidence reset (`EvidenceTimes`), since a late redelivery must not roll
the evidence back, nor a report from before a redeploy describe the host as it is now.

Methods still to come as later issues move them here: approve (candidates into slots), reserve/follow/end of a
slot's claim, a GPU's health quarantine and capacity held for a reservation.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any

from . import drift as drift_rules
from .approval import DEFAULT_WIPE_POLICY
from .host_mode import (
    BAREMETAL,
    CONVERTING,
    RESETS_EVIDENCE,
    HostFacts,
    ModeChange,
    ModeRefused,
    changed,
    transition_problems,
)
from .node_claims import SlotsMoved
from .slot_wipe import ReturnFacts, wipe_on_return
from .vfio_binding import SlotDevices, binding_change

REASON_MAX = 500  # the slot's status_reason column


@dataclass(frozen=True)
class HostSlot:
    """One slot of the host as its guards read it (locked with the node)."""

    slot_id: str
    status: str
    nvme_by_id: str | None = None
    wipe_policy: str | None = None  # the effective one: the site's, else the slot's own
    claimed: bool = False  # a live claim holds it
    wipe_open: bool = False  # a wipe ask of it is open
    gpu_pci_address: str | None = None
    fabric_vf_pci_address: str | None = None

    @property
    def devices(self) -> SlotDevices:
        return SlotDevices(self.slot_id, self.gpu_pci_address, self.fabric_vf_pci_address, self.status)


@dataclass(frozen=True)
class Drained:
    node_id: str
    reason: str
    actor: str
    maintenance: bool


@dataclass(frozen=True)
class Undrained:
    node_id: str


@dataclass(frozen=True)
class WipeAsked:
    """The host is asked to wipe these slots' disks (`slice.slot_wipe`), one ask row per slot."""

    node_id: str
    task_id: str
    slots: tuple[tuple[str, str, str], ...]  # (slot_id, nvme_by_id, wipe_policy)
    cause: str
    why: str
    actor: str


@dataclass(frozen=True)
class ModeChanged:
    """A guarded mode change, with the VFIO binding it asks of the host's agent (None: none)."""

    change: ModeChange
    binding: tuple[str, tuple[SlotDevices, ...]] | None


@dataclass(frozen=True)
class EvidenceTimes:
    """When the host's last report of each kind was taken, and its last evidence reset (None: never)."""

    parity: datetime | None = None
    topology: datetime | None = None
    drift: datetime | None = None
    reset: datetime | None = None


@dataclass(frozen=True)
class ParityRecorded:
    node_id: str
    failures: int
    detail: dict[str, Any]
    checked_at: datetime


@dataclass(frozen=True)
class TopologyRecorded:
    """The host's topology as reported: its node columns, and its candidates (`candidates`: rows of
    (candidate_id, node_id, *CANDIDATE_FIELDS, nvme evidence json or None)) replacing the unapproved ones."""

    node_id: str
    discovered_at: datetime
    blockers: tuple[Any, ...]
    hugepages_1g_total: int | None
    hugepages_1g_free: int | None
    fabric_manager: tuple[str | None, str | None, bool | None]
    candidates: tuple[tuple[Any, ...], ...]


@dataclass(frozen=True)
class DriftRecorded:
    """A drift report taken: kept as it came (`report`, under `event_id`; the host keeps its `keep` newest), and
    the host's drift items opened, kept or resolved as `change` says."""

    node_id: str
    event_id: str
    checked_at: datetime
    report: tuple[dict[str, Any], ...]
    change: drift_rules.Change
    keep: int


Change = Drained | Undrained | WipeAsked | SlotsMoved | ModeChanged | ParityRecorded | TopologyRecorded | DriftRecorded

APPLIED, STALE = "applied", "stale"


@dataclass(frozen=True)
class MaintenanceEnd:
    """What an undrain out of maintenance asked: the wipe task (None: no disk to wipe), the slots moved to
    `awaiting_wipe` and every slot asked."""

    wipe_task: str | None
    awaiting_wipe: tuple[str, ...]
    wipe_asked: tuple[str, ...]

    def view(self) -> dict[str, object]:
        return {
            "wipe_task": self.wipe_task,
            "awaiting_wipe": list(self.awaiting_wipe),
            "wipe_asked": list(self.wipe_asked),
        }


@dataclass
class Host:
    """`facts`: what the mode guards read; `draining`/`maintenance`: the node's drain; `slots`: every slot, in id
    order; `now`: the transaction's clock, the one the mode history and evidence resets are written with."""

    facts: HostFacts
    now: datetime
    draining: bool = False
    maintenance: bool = False
    slots: tuple[HostSlot, ...] = ()
    evidence: EvidenceTimes = EvidenceTimes()
    changes: list[Change] = field(default_factory=list)

    @property
    def node_id(self) -> str:
        return self.facts.node_id

    @property
    def mode(self) -> str:
        return self.facts.mode

    # --- mode -----------------------------------------------------------------------------------------------

    def blockers(self, target: str) -> list[str]:
        return transition_problems(self.facts, target)

    def change_mode(self, target: str, *, actor: str, reason: str, allocation_id: str | None = None) -> ModeChange:
        """Raises ModeRefused, changing nothing, when a guard of host_mode.TRANSITIONS refuses."""
        problems = self.blockers(target)
        if problems:
            raise ModeRefused(self.node_id, self.mode, target, problems)
        resets = target in RESETS_EVIDENCE
        change = ModeChange(self.node_id, self.mode, target, actor, reason, self.now, resets, allocation_id)
        binding = binding_change(self.mode, target, [s.devices for s in self.slots])
        self.facts = changed(self.facts, target)
        self.changes.append(ModeChanged(change, (binding[0], tuple(binding[1])) if binding else None))
        return change

    def return_from_baremetal(self, *, actor: str, reason: str, allocation_id: str) -> ModeChange | None:
        """After its baremetal allocation is released. MAAS redeployed the host, so its slice bootstrap is gone: a
        slice-capable host goes to `converting`; a baremetal-only one stays in the baremetal pool (None)."""
        if self.mode != BAREMETAL or not self.facts.accepts_slices:
            return None
        return self.change_mode(CONVERTING, actor=actor, reason=reason, allocation_id=allocation_id)

    # --- drain ----------------------------------------------------------------------------------------------

    def drain(self, reason: str, *, actor: str, maintenance: bool) -> None:
        """No new placements; a maintenance drain also makes the undrain owe the host's wipe proof."""
        self.draining = True
        self.maintenance = self.maintenance or maintenance
        self.changes.append(Drained(self.node_id, reason, actor, maintenance))

    def undrain(self, reason: str, *, actor: str, wipe_task: str) -> MaintenanceEnd | None:
        """Placements again. Out of maintenance (a technician may have swapped or touched its disks) each slot
        disk that slot_wipe.MAINTENANCE_RETURN_RULES names owes the host's wipe proof, asked under `wipe_task`,
        its free slots `awaiting_wipe` meanwhile; None when the node was in no maintenance."""
        ended = self._end_maintenance(reason, actor, wipe_task) if self.maintenance else None
        self.draining = self.maintenance = False
        self.changes.append(Undrained(self.node_id))
        return ended

    def _end_maintenance(self, reason: str, actor: str, task_id: str) -> MaintenanceEnd:
        asked, moves, whys = self._owed_wipes()
        if not asked:
            return MaintenanceEnd(None, (), ())
        why = f"undrain by {actor} after maintenance: {reason}; " + "; ".join(sorted(whys))
        wiped = tuple((s.slot_id, s.nvme_by_id or "", s.wipe_policy or DEFAULT_WIPE_POLICY) for s in asked)
        self.changes.append(WipeAsked(self.node_id, task_id, wiped, "maintenance", why, actor))
        detail = {"cause": "maintenance", "wipe_task": task_id, "undrain_reason": reason}
        moved = self._move_awaiting(moves, detail, actor)
        return MaintenanceEnd(task_id, tuple(moved), tuple(s.slot_id for s in asked))

    def _owed_wipes(self) -> tuple[list[HostSlot], dict[tuple[str, str, str], list[str]], set[str]]:
        """The slots whose disk owes a wipe on the return, their moves by (from, to, why), and the whys."""
        asked: list[HostSlot] = []
        moves: dict[tuple[str, str, str], list[str]] = {}
        whys: set[str] = set()
        for slot in self.slots:
            decision = wipe_on_return(ReturnFacts(slot.status, slot.claimed, slot.wipe_open))
            # A disk without a stable identity is no disk the agent may wipe; the binding rules keep it disabled.
            if not decision.ask or "/by-id/" not in (slot.nvme_by_id or ""):
                continue
            whys.add(decision.why)
            asked.append(slot)
            if decision.to is not None:
                moves.setdefault((slot.status, decision.to, decision.why), []).append(slot.slot_id)
        return asked, moves, whys

    def _move_awaiting(
        self, moves: dict[tuple[str, str, str], list[str]], detail: dict[str, Any], actor: str
    ) -> list[str]:
        moved: list[str] = []
        for (came_from, to, decision_why), ids in sorted(moves.items()):
            text = ("awaiting the host agent's wipe proof: " + decision_why)[:REASON_MAX]
            self.changes.append(SlotsMoved(tuple(ids), to, text, (came_from,), detail, actor=actor))
            moved += ids
        moved_to = {slot_id: to for (_from, to, _why), ids in moves.items() for slot_id in ids}
        self.slots = tuple(replace(s, status=moved_to.get(s.slot_id, s.status)) for s in self.slots)
        return moved

    # --- evidence: parity, topology, drift (issue 39) ---------------------------------------------------------

    def _takes(self, last: datetime | None, at: datetime, *, strictly_newer: bool = False) -> bool:
        """A report dated `at` is newer than the last one taken (`last`) and than the evidence reset. Parity and
        topology take a report of the same time again (it rewrites the same values); drift takes only a strictly
        newer one, as its statement always did: one report's time opens and resolves items once."""
        if self.evidence.reset is not None and self.evidence.reset >= at:
            return False
        if last is None:
            return True
        return last < at if strictly_newer else last <= at

    def record_parity(
        self, *, failures: int, detail: dict[str, Any], checked_at: datetime, emulated_refused: str | None = None
    ) -> str:
        """'applied' or 'stale'. `emulated_refused`: why a report of the emulated profile may not pass here; it is
        recorded with one failure more, so the host never takes slices on the strength of checks it skipped."""
        if not self._takes(self.evidence.parity, checked_at):
            return STALE
        if emulated_refused is not None:
            failures, detail = failures + 1, {**detail, "refused": emulated_refused}
        self.evidence = replace(self.evidence, parity=checked_at)
        self.facts = replace(self.facts, parity_failures=failures)
        self.changes.append(ParityRecorded(self.node_id, failures, detail, checked_at))
        return APPLIED

    def record_topology(
        self,
        *,
        discovered_at: datetime,
        blockers: Sequence[Any],
        hugepages_1g: tuple[int | None, int | None],
        fabric_manager: tuple[str | None, str | None, bool | None],
        candidates: Iterable[tuple[Any, ...]],
    ) -> str:
        """'applied' or 'stale'. Advisory: candidates replace the unapproved ones, no slot is created or changed."""
        if not self._takes(self.evidence.topology, discovered_at):
            return STALE
        self.evidence = replace(self.evidence, topology=discovered_at)
        self.facts = replace(self.facts, rediscovered=True)
        total, free = hugepages_1g
        self.changes.append(
            TopologyRecorded(
                self.node_id, discovered_at, tuple(blockers), total, free, fabric_manager, tuple(candidates)
            )
        )
        return APPLIED

    def record_drift(
        self,
        *,
        event_id: str,
        checked_at: datetime,
        report: Sequence[dict[str, Any]],
        reported: Mapping[drift_rules.DriftKey, drift_rules.Item],
        held: Iterable[drift_rules.DriftKey],
        keep: int,
    ) -> drift_rules.Change | None:
        """The agent's full current drift (`reported`, by key, see drift.current_items) against the host's
        unresolved items (`held`): what opens, stays and resolves; None for a stale report."""
        if not self._takes(self.evidence.drift, checked_at, strictly_newer=True):
            return None
        change = drift_rules.reconcile(held, reported)
        self.evidence = replace(self.evidence, drift=checked_at)
        self.changes.append(DriftRecorded(self.node_id, event_id, checked_at, tuple(report), change, keep))
        return change
