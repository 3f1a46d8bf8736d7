"""slice.vm_release: stop and undefine the VM, drop its DHCP reservation and seed, then wipe and verify every
disk (all re-checked first); the leases go only once every wipe is proven."""

from __future__ import annotations

from gpuaas_common.contract import messages as m

from ...adapters import disk, dnsmasq
from . import nvlink
from .core import AgentCore, Refused, TaskFailed, log


class ReleaseTask(AgentCore):
    async def _release(self, task: m.SliceVmRelease) -> m.NodeTaskResult:
        t = "slice.vm_release"
        await self._phase(task, t, "stop")
        stop_path = "absent"
        try:
            if await self.libvirt.exists(task.vm_name):
                stopped = await self.libvirt.shutdown(task.vm_name, self.shutdown_timeout_s)
                stop_path = stopped.value
                await self._phase(task, t, "undefine", detail=f"stop path: {stopped.value}")
                await self.libvirt.undefine(task.vm_name)
            # Never under a running VM: only once it is shut down (or was never there).
            await nvlink.deactivate(self, task)
            dnsmasq.remove_reservation(self.hostsdir, task.vm_name)
            if task.slots:
                primary = task.slots[0]
                await dnsmasq.release_lease(
                    self.host, primary.ovs_bridge, primary.private_ip, primary.mac, self.lease_file
                )
            seed = self.seed_dir / f"{task.vm_name}.iso"
            seed.unlink(missing_ok=True)
            (self.seed_dir / f"{task.vm_name}.hostkey").unlink(missing_ok=True)
            (self.seed_dir / f"{task.vm_name}.console.log").unlink(missing_ok=True)
            # Every disk is re-checked before the first one is wiped: host state may have changed since provision.
            paths = [(slot, self._check_disk(slot.nvme_by_id)) for slot in task.slots]
            await self._phase(task, t, "wipe", disk_touched=True)
            proofs = []
            for slot, path in paths:
                # The site's policy came with the slot from placement; an older scheduler sends none.
                proof = await disk.wipe_and_verify(str(path), slot.wipe_policy)
                proofs.append(
                    m.WipeProof(
                        device=slot.nvme_by_id,
                        method=proof.method,
                        verified=proof.verified,
                        signatures=[str(sig) for sig in proof.signatures],
                        detail=proof.detail,
                        verification=proof.verification,
                    )
                )
        except Refused:
            raise
        except Exception as exc:
            raise TaskFailed("release_error", f"{type(exc).__name__}: {exc}") from exc
        unverified = [p for p in proofs if not p.verified]
        if unverified:
            # The leases stay: the disks still hold tenant data as far as anyone can prove.
            reason = "; ".join(f"{p.device}: {p.detail or 'not verified'}" for p in unverified)
            log.error("wipe_not_verified", task_id=task.task_id, allocation_id=str(task.allocation_id), reason=reason)
            return self._result(
                task,
                t,
                "failed",
                code="wipe_unverified",
                reason=reason[:2000],
                cleanup_required=True,
                proofs=proofs,
                stop_path=stop_path,
            )
        self.store.drop_leases(str(task.allocation_id))
        await self._phase(task, t, "released")
        return self._result(task, t, "succeeded", proofs=proofs, stop_path=stop_path)
