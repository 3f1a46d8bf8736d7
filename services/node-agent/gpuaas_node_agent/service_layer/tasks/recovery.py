"""Start-up recovery: resume the tasks a killed agent left running (a restart is not a failure), then one pass
of the reconciler, which brings libvirt in line with the task records."""

from __future__ import annotations

import asyncio

from gpuaas_common.contract import TaskType
from gpuaas_common.contract import messages as m

from ...adapters.state_store import StateStore
from .context import log
from .reconciler import HostReconciler
from .runner import TaskRunner

_TASK_MODELS: dict[str, type[m.Payload]] = {
    TaskType.SLICE_VM_PROVISION: m.SliceVmProvision,
    TaskType.SLICE_VM_RELEASE: m.SliceVmRelease,
}


class TaskRecovery:
    def __init__(self, store: StateStore, runner: TaskRunner, reconciler: HostReconciler) -> None:
        self.store = store
        self.runner = runner
        self.reconciler = reconciler

    async def recover(self) -> list[m.NodeTaskResult]:
        """Resume what a previous run left half-done under the same claim and fencing epoch (tasks on disjoint
        slots in parallel, as at run time), then bring libvirt in line with the task records. A provision that
        cannot resume is wiped and verified here, and its result carries the proof."""
        resumed = []
        for record in self.store.running_tasks():
            model = _TASK_MODELS.get(record["task_type"])
            if model is None or record["payload"] is None:
                continue
            task = model.model_validate(record["payload"])
            log.warning(
                "task_recovering",
                task_id=task.task_id,
                allocation_id=str(task.allocation_id),
                task_type=record["task_type"],
                disk_touched=record["disk_touched"],
            )
            resumed.append(self.runner.execute(record["task_type"], task))
        results = list(await asyncio.gather(*resumed))
        await self.reconciler.reconcile_host()
        return results
