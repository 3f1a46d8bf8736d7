"""The NVLink partition of a slice VM on its host (issue 29, point 3), in the order the shared-NVSwitch model
requires: reset the GPUs, activate the partition, start the VM; shut the VM down, deactivate, reset the GPUs.

Fabric Manager's FM_ST_IN_USE is the last guard against double booking, never the scheduler: a provision it
refuses is refused before its disk is touched. The agent keeps its own record of which VM holds which partition
(beside the seeds), so that after Fabric Manager restarts it can re-send the active list inside the 60-second
window, and so that reconciliation can tell an orphaned partition from a VM running without its NVLinks.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from gpuaas_common.cancellation import stop_if_cancelled

from ...adapters.fabric_manager import IN_USE, FabricManager, FabricManagerError, fabric_manager_for
from ...adapters.host import Host
from .context import Refused, log

# How often the agent looks for a Fabric Manager restart: well inside its 60-second window.
WATCH_INTERVAL_S = 5.0


def _gpus(task: Any) -> list[str]:
    return [s.gpu_pci_address for s in task.slots if s.gpu_pci_address]


class NvlinkPartitions:
    """The partitions this host's VMs hold, through the host's Fabric Manager (`fabric_manager`: tests and the
    simulated fleet give their own; by default the host's adapter, made on first use)."""

    def __init__(self, host: Host, seed_dir: Path, fabric_manager: FabricManager | None = None) -> None:
        self._host = host
        self._seed_dir = seed_dir
        self._fabric = fabric_manager

    def fabric(self) -> FabricManager:
        if self._fabric is None:
            self._fabric = fabric_manager_for(self._host, self._seed_dir)
        return self._fabric

    def _record_path(self) -> Path:
        return self._seed_dir / "nvlink-partitions.json"

    def held(self) -> dict[str, int]:
        """VM name -> the partition the agent activated for it and has not deactivated."""
        try:
            return {str(k): int(v) for k, v in json.loads(self._record_path().read_text()).items()}
        except (FileNotFoundError, ValueError):
            return {}

    def _save(self, record: dict[str, int]) -> None:
        path = self._record_path()
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(record, sort_keys=True))
        tmp.replace(path)

    async def activate(self, task: Any) -> None:
        """Reset the task's GPUs and activate its partition; Refused (nothing written to any disk yet) when Fabric
        Manager says the partition or one of its GPUs is in use, or cannot activate now."""
        pid = task.nvlink_partition
        if pid is None:
            return
        fm = self.fabric()
        try:
            if self.held().get(task.vm_name) == pid and pid in await fm.active():
                return  # this VM's own activation, from before an agent restart
            await fm.reset_gpus(_gpus(task))
            await fm.activate(pid)
        except FabricManagerError as exc:
            code = "nvlink_partition_in_use" if exc.code == IN_USE else "nvlink_activation_failed"
            raise Refused(code, f"NVLink partition {pid}: {exc}") from exc
        self._save({**self.held(), task.vm_name: pid})
        log.info("nvlink_partition_activated", task_id=task.task_id, vm=task.vm_name, partition=pid)

    async def deactivate(self, task: Any) -> None:
        """After the VM is shut down: deactivate the partition it held and reset its GPUs. Raises
        FabricManagerError when Fabric Manager refuses (inside its restart window, or not running): the release
        must not report the GPUs free while their partition may still be active."""
        record = self.held()
        pid = record.get(task.vm_name, task.nvlink_partition)
        if pid is None:
            return
        fm = self.fabric()
        if pid in await fm.active():
            await fm.deactivate(pid)
        await fm.reset_gpus(_gpus(task))
        record.pop(task.vm_name, None)
        self._save(record)
        log.info("nvlink_partition_deactivated", task_id=task.task_id, vm=task.vm_name, partition=pid)

    async def deactivate_quietly(self, task: Any) -> None:
        """For a provision torn down on failure or refusal: a Fabric Manager that will not deactivate now leaves
        the record, which reconciliation reports until the release or ops settle it."""
        try:
            await self.deactivate(task)
        except FabricManagerError as exc:
            log.error("nvlink_partition_not_deactivated", task_id=task.task_id, vm=task.vm_name, error=str(exc))

    async def resend_if_restarted(self, last: str | None) -> str | None:
        """Fabric Manager restarted since `last` (its generation changed): send the partitions of the VMs the
        agent holds, an empty list included, which Fabric Manager needs within 60 seconds or it exits. The
        generation now, to pass back next time."""
        fm = self.fabric()
        now = await fm.generation()
        if now is not None and last is not None and now != last:
            partitions = sorted(set(self.held().values()))
            await fm.set_activated(partitions)
            log.warning("nvlink_active_list_resent", generation=now, partitions=partitions)
        return now

    async def watch_restarts(self, interval_s: float = WATCH_INTERVAL_S) -> None:
        last: str | None = None
        while True:
            stop_if_cancelled()
            try:
                last = await self.resend_if_restarted(last)
            except FabricManagerError as exc:
                log.error("nvlink_active_list_not_resent", error=str(exc))
            await asyncio.sleep(interval_s)

    async def drift(self, live_vms: set[str]) -> list[tuple[str, str]]:
        """(subject, detail) of every disagreement between Fabric Manager and the agent's record: a partition
        active with no VM of the agent's behind it, or a live VM whose partition is not active (its guest's CUDA
        fails with error 802 until it is)."""
        fm = self.fabric()
        try:
            active = set(await fm.active())
        except FabricManagerError as exc:
            record = self.held()
            return [("fabric_manager", f"cannot list partitions: {exc}")] if record else []
        record = self.held()
        out = []
        for vm, pid in sorted(record.items()):
            if vm in live_vms and pid not in active:
                out.append((f"partition:{pid}", f"VM {vm} runs without its NVLink partition {pid} active"))
        mine = {pid for vm, pid in record.items() if vm in live_vms}
        for pid in sorted(active - mine):
            out.append((f"partition:{pid}", f"NVLink partition {pid} is active with no live VM of the agent's"))
        return out
