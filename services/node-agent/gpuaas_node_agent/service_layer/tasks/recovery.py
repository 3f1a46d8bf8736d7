"""Start-up recovery: resume the tasks a killed agent left running (a restart is not a failure), then bring
libvirt in line with the task records."""

from __future__ import annotations

import asyncio

from gpuaas_common.contract import messages as m

from .core import log
from .reconciler import HostReconciler

_TASK_MODELS: dict[str, type[m.Payload]] = {
    "slice.vm_provision": m.SliceVmProvision,
    "slice.vm_release": m.SliceVmRelease,
}


class TaskRecovery(HostReconciler):
    # --- start-up ---------------------------------------------------------------------------------

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
            resumed.append(self.execute(record["task_type"], task))
        results = list(await asyncio.gather(*resumed))
        await self.reconcile_host()
        return results

    async def reconcile_domains(self) -> None:
        """A domain whose last task was a failed provision or a finished release must not exist: stop and
        undefine it. Domains the agent has no record of are reported and left alone (not ours to touch), and
        so is a domain whose task is running."""
        latest = self.store.latest_by_vm()
        for dom in await self.libvirt.list_domains():
            record = latest.get(dom.name)
            if record is None:
                log.info("libvirt_domain_unmanaged", domain=dom.name, state=dom.state.value)
                continue
            lock = self._vm_locks.setdefault(dom.name, asyncio.Lock())
            if lock.locked():
                continue  # its task is running: the task decides what becomes of the domain
            async with lock:
                # Under the VM's lock: a task for it waits until the domain is gone, never sees it half torn.
                task_type, status = self.store.latest_by_vm().get(dom.name, record)
                stale = (task_type == "slice.vm_provision" and status in ("failed", "refused")) or (
                    task_type == "slice.vm_release" and status == "succeeded"
                )
                if stale:
                    await self.libvirt.shutdown(dom.name, 0)
                    await self.libvirt.undefine(dom.name)
                    log.warning("libvirt_domain_reconciled", domain=dom.name, last_task=task_type, last_status=status)
