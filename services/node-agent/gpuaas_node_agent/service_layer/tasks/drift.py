"""Drift: one disagreement between the host and the agent's records, as `node.drift_reported` carries it, and
what the reconciler reads of the records to find one."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gpuaas_common.contract import TaskType
from gpuaas_common.contract import messages as m


@dataclass(frozen=True)
class Drift:
    kind: str  # see messages.DriftKind
    subject: str
    detail: str
    swept: bool = False
    # Where it bites: the slots it concerns (by id, or by a device of theirs); neither = the whole node.
    slot_ids: tuple[str, ...] = ()
    devices: tuple[str, ...] = ()

    def message(self) -> m.NodeDrift:
        return m.NodeDrift(
            kind=self.kind,  # type: ignore[arg-type]  # the kinds written here are the contract's
            subject=self.subject[:1024],
            detail=self.detail[:2048],
            swept=self.swept,
            slot_ids=list(self.slot_ids),
            devices=list(self.devices),
        )


def live(record: tuple[str, str] | None) -> bool:
    """A VM the records say should exist (or may, while its task runs)."""
    if record is None:
        return False
    task_type, status = record
    return (task_type == TaskType.SLICE_VM_PROVISION and status in ("running", "succeeded")) or (
        task_type == TaskType.SLICE_VM_RELEASE and status in ("running", "failed", "refused")
    )


def slots_using(slots: dict[str, dict[str, Any]], device: str) -> tuple[str, ...]:
    fields = ("gpu_pci_address", "fabric_vf_pci_address", "nvme_by_id")
    return tuple(sorted(s for s, rec in slots.items() if device in (rec["binding"].get(f) for f in fields)))
