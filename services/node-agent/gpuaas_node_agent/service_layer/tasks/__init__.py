"""Node tasks: one task message in, host work done in phases, one result out.

Idempotent per task id through the local state store; a stale fencing epoch or a resource leased to
another allocation is refused before anything destructive runs; every result says `disk_touched`, false
only when the task's record shows no disk write ever began, so the scheduler never hands a slot out unwiped.
Every task runs within its deadline, and a task a killed agent left half-done is resumed on restart under
the same claim and fencing epoch; a provision that cannot resume after it wrote the disk is wiped and
verified by the agent, with the proof in its result — exactly one result either way.

Each concern is a task object given, in its constructor, only the collaborators it uses; none inherits from
another. The modules:

- context: what every task object is given (HostContext: the host's adapters and the agent's directories on it),
  the slot and VM locks (TaskLocks), and the Refused and TaskFailed exceptions;
- phases: a task's phases recorded and published as progress, and its result;
- disks: the disk identity check before a disk is touched, and the wipe proof;
- preflight: a provision's host, image and domain XML checks before anything is written;
- nvlink: the NVLink partitions the host's VMs hold, through Fabric Manager (NvlinkPartitions);
- provision, release: slice.vm_provision and slice.vm_release (ProvisionTask, ReleaseTask);
- runner: one task end to end, dispatched to the task object of its type (TaskRunner);
- recovery: the tasks a killed agent left running, resumed at start-up (TaskRecovery);
- drift, reconciler: the host held against the records, drift reported (HostReconciler);
- evidence: topology and parity (HostEvidence); vfio: the approved devices bound (VfioBinding);
- slot_wipe: the disks of slots no tenant holds wiped on the scheduler's ask (SlotWiper);
- agent: SliceHostAgent, which assembles them for one host.
"""

from __future__ import annotations

from .agent import SliceHostAgent
from .context import HostContext, Publish, Refused, TaskFailed
from .provision import HUGEPAGES_1G_FREE
from .runner import SLICE_TASKS

__all__ = [
    "HUGEPAGES_1G_FREE",
    "SLICE_TASKS",
    "HostContext",
    "Publish",
    "Refused",
    "SliceHostAgent",
    "TaskFailed",
]
