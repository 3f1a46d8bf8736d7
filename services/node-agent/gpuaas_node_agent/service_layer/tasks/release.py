"""slice.vm_release: stop and undefine the VM, drop its DHCP reservation and seed, then wipe and verify every
disk (all re-checked first); the leases go only once every wipe is proven."""

from __future__ import annotations

from typing import Any

from gpuaas_common.contract import TaskType
from gpuaas_common.contract import messages as m

from ...adapters import disk, dnsmasq
from . import phases
from .context import HostContext, Refused, TaskFailed, log
from .disks import check_disk, wipe_proof
from .nvlink import NvlinkPartitions


class ReleaseTask:
    def __init__(self, ctx: HostContext, nvlink: NvlinkPartitions, *, shutdown_timeout_s: float) -> None:
        self.ctx = ctx
        self.nvlink = nvlink
        self.shutdown_timeout_s = shutdown_timeout_s

    async def run(self, task: m.SliceVmRelease, left_running: dict[str, Any] | None) -> m.NodeTaskResult:
        """A release a killed agent left running simply runs again: every step is idempotent."""
        ctx = self.ctx
        t = TaskType.SLICE_VM_RELEASE
        await phases.enter(ctx, task, t, "stop")
        stop_path = "absent"
        try:
            if await ctx.libvirt.exists(task.vm_name):
                stopped = await ctx.libvirt.shutdown(task.vm_name, self.shutdown_timeout_s)
                stop_path = stopped.value
                await phases.enter(ctx, task, t, "undefine", detail=f"stop path: {stopped.value}")
                await ctx.libvirt.undefine(task.vm_name)
            # Never under a running VM: only once it is shut down (or was never there).
            await self.nvlink.deactivate(task)
            dnsmasq.remove_reservation(ctx.hostsdir, task.vm_name)
            if task.slots:
                primary = task.slots[0]
                await dnsmasq.release_lease(
                    ctx.host, primary.ovs_bridge, primary.private_ip, primary.mac, ctx.lease_file
                )
            seed = ctx.seed_dir / f"{task.vm_name}.iso"
            seed.unlink(missing_ok=True)
            (ctx.seed_dir / f"{task.vm_name}.hostkey").unlink(missing_ok=True)
            (ctx.seed_dir / f"{task.vm_name}.console.log").unlink(missing_ok=True)
            # Every disk is re-checked before the first one is wiped: host state may have changed since provision.
            paths = [(slot, check_disk(ctx.host, slot.nvme_by_id)) for slot in task.slots]
            await phases.enter(ctx, task, t, "wipe", disk_touched=True)
            proofs = []
            for slot, path in paths:
                # The site's policy came with the slot from placement; an older scheduler sends none.
                proof = await disk.wipe_and_verify(str(path), slot.wipe_policy)
                proofs.append(wipe_proof(slot.nvme_by_id, proof))
        except Refused:
            raise
        except Exception as exc:
            raise TaskFailed("release_error", f"{type(exc).__name__}: {exc}") from exc
        unverified = [p for p in proofs if not p.verified]
        if unverified:
            # The leases stay: the disks still hold tenant data as far as anyone can prove.
            reason = "; ".join(f"{p.device}: {p.detail or 'not verified'}" for p in unverified)
            log.error("wipe_not_verified", task_id=task.task_id, allocation_id=str(task.allocation_id), reason=reason)
            return phases.result(
                ctx,
                task,
                t,
                "failed",
                code="wipe_unverified",
                reason=reason[:2000],
                cleanup_required=True,
                proofs=proofs,
                stop_path=stop_path,
            )
        ctx.store.drop_leases(str(task.allocation_id))
        await phases.enter(ctx, task, t, "released")
        return phases.result(ctx, task, t, "succeeded", proofs=proofs, stop_path=stop_path)
