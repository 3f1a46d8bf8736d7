"""The slice host agent: the task runner with recovery and readiness evidence."""

from __future__ import annotations

from .recovery import TaskRecovery
from .slot_wipe import SlotWiper
from .vfio import HostBinding


class SliceHostAgent(TaskRecovery, HostBinding, SlotWiper):
    """Provision and release tasks (provision.py, release.py) run through runner.py; recovery.py finishes what
    a previous run left half-done; evidence.py reports topology and parity; vfio.py binds the approved devices;
    slot_wipe.py wipes the disks of slots no tenant holds when the scheduler asks."""
