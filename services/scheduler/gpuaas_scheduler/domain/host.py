"""Host: one node, its slots and its mode, the consistency boundary of what ops and the host's own reports do to
it (issue 39). Pure: no I/O.

Loaded whole under the node's row lock (adapters/hosts.py), changed only through its methods, which check their
own rules and record what they did in `changes`; the repository writes what was recorded and the service layer
turns it into the unit of work's events (service_layer/hosts.py). So an admin action reads: parse, load, one
method, save.

The rules stay where they are written as tables and pure functions: the mode machine in host_mode.py, the
maintenance return in slot_wipe.py, the VFIO binding in vfio_binding.py. This aggregate applies them to one host.

Methods still to come as later issues move them here: approve (candidates into slots), reserve/follow/end of a
slot's claim, record_parity/topology/drift, a GPU's health quarantine and capacity held for a reservation.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from datetime import datetime

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


Change = Drained | Undrained | WipeAsked | SlotsMoved | ModeChanged


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
        asked: list[HostSlot] = []
        moves: dict[tuple[str, str, str], list[str]] = {}  # (from, to, why): slots
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
        if not asked:
            return MaintenanceEnd(None, (), ())
        why = f"undrain by {actor} after maintenance: {reason}; " + "; ".join(sorted(whys))
        wiped = tuple((s.slot_id, s.nvme_by_id or "", s.wipe_policy or DEFAULT_WIPE_POLICY) for s in asked)
        self.changes.append(WipeAsked(self.node_id, task_id, wiped, "maintenance", why, actor))
        moved: list[str] = []
        detail = {"cause": "maintenance", "wipe_task": task_id, "undrain_reason": reason}
        for (came_from, to, decision_why), ids in sorted(moves.items()):
            text = ("awaiting the host agent's wipe proof: " + decision_why)[:REASON_MAX]
            self.changes.append(SlotsMoved(tuple(ids), to, text, (came_from,), detail, actor=actor))
            moved += ids
        moved_to = {slot_id: to for (_from, to, _why), ids in moves.items() for slot_id in ids}
        self.slots = tuple(replace(s, status=moved_to.get(s.slot_id, s.status)) for s in self.slots)
        return MaintenanceEnd(task_id, tuple(moved), tuple(s.slot_id for s in asked))
