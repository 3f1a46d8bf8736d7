"""Which VFIO binding a host's agent is asked for when its mode or its approved slots change. Pure: no I/O.

Runbook (slice-node-bootstrap): "Persistent VFIO binding: apply only after the node is intentionally in slice
mode", generated from the approved topology, never a hard-coded PCI list. So a host entering slice mode, or
whose approved set changes there, is asked to bind its approved slots' GPUs and fabric VFs; a host leaving the
modes that keep slices (slice, drained: live slices run to their end there) is asked to release them, which a
baremetal tenant's host drivers need back.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from gpuaas_common.contract import SlotStatus

from .host_mode import DRAINED, SLICE

# The modes whose host keeps its approved devices on vfio-pci.
BOUND_MODES = frozenset({SLICE, DRAINED})
RETIRED_SLOT = SlotStatus.RETIRED


@dataclass(frozen=True)
class SlotDevices:
    slot_id: str
    gpu_pci_address: str | None
    fabric_vf_pci_address: str | None
    status: str


def binding_change(from_mode: str, to_mode: str, slots: Iterable[SlotDevices]) -> tuple[str, list[SlotDevices]] | None:
    """(`bind` with the approved slots, or `unbind` with every slot the host may have bound) for a host going
    from `from_mode` to `to_mode` (the same mode twice: its approved set changed); None when nothing is to be
    asked. Emulated slots pass nothing through and are left out; a host with none left is asked nothing."""
    passing = [s for s in slots if s.gpu_pci_address]
    if to_mode == SLICE:
        approved = [s for s in passing if s.status != RETIRED_SLOT]
        return ("bind", approved) if approved else None
    if from_mode in BOUND_MODES and to_mode not in BOUND_MODES:
        # Retired slots too: retiring a slot does not unbind its device, leaving the mode does.
        return ("unbind", passing) if passing else None
    return None
