"""Node tasks: one task message in, host work done in phases, one result out.

Idempotent per task id through the local state store; a stale fencing epoch or a resource leased to
another allocation is refused before anything destructive runs; every result says `disk_touched`, false
only when the task's record shows no disk write ever began, so the scheduler never hands a slot out unwiped.
Every task runs within its deadline, and a task a killed agent left half-done is resumed on restart under
the same claim and fencing epoch; a provision that cannot resume after it wrote the disk is wiped and
verified by the agent, with the proof in its result — exactly one result either way.

The agent is assembled from one module per concern: core (wiring, exceptions, phases, disk check), provision,
release, runner (one task end to end), recovery (start-up), reconciler (host against records) and evidence
(topology and parity).
"""

from __future__ import annotations

from .agent import SliceHostAgent
from .core import AgentCore, Publish, Refused, TaskFailed
from .provision import HUGEPAGES_1G_FREE
from .runner import SLICE_TASKS

__all__ = [
    "HUGEPAGES_1G_FREE",
    "SLICE_TASKS",
    "AgentCore",
    "Publish",
    "Refused",
    "SliceHostAgent",
    "TaskFailed",
]
