"""The host's VFIO binding as the scheduler asks for it (slice.vfio_apply): the approved slots' GPUs and fabric
VFs bound to vfio-pci under persistent overrides on entering slice mode, released on leaving it.

The approved slots of the last binding applied are kept in the host's own state, and parity's `vfio_binding`
takes them, and only them, as the approved set: a provision task's slots say where a VM goes, not what the
host must have bound, so a forged one cannot fail a host's parity. A binding that names a device the host's
own topology does not show as a GPU or a fabric VF is refused whole with the devices named, and nothing
changes; so is an unbind that names nothing the host had bound.
"""

from __future__ import annotations

import asyncio

from gpuaas_common.bus import HandlerContext, PermanentError
from gpuaas_common.contract import messages as m
from gpuaas_common.contract import utcnow

from ...adapters import driverctl
from ...adapters.discovery import discover
from ...domain.device_binding import VFIO_DRIVER, approved_devices, refused_devices, release_set, slot_pairs
from ..device_binding import enter_slice_mode
from .context import HostContext, log
from .evidence import HostEvidence, evidence_task_due


class VfioBinding:
    """`evidence`: parity goes out after every mode change; `gpu_bridge`: the bridge discovery looks at."""

    def __init__(self, ctx: HostContext, evidence: HostEvidence, *, gpu_bridge: str = "ovsbr0") -> None:
        self.ctx = ctx
        self.evidence = evidence
        self.gpu_bridge = gpu_bridge

    async def on_vfio_apply(self, ctx: HandlerContext) -> None:
        task: m.SliceVfioApply = ctx.payload
        if not evidence_task_due(self.ctx.node_id, task):
            return
        ids = {"task_id": task.task_id, "action": task.action}
        async with asyncio.timeout((task.deadline - utcnow()).total_seconds()):
            if task.action == "bind":
                await self._bind(task)
            else:
                await self._unbind(task)
            # Parity after every mode change: the scheduler reads the binding's outcome there.
            parity = await self.evidence.report_parity(task_id=task.task_id)
        log.info("vfio_binding_applied", **ids, slots=len(task.slots), parity_failures=parity.failures)

    async def _bind(self, task: m.SliceVfioApply) -> None:
        asked = approved_devices((s.gpu_pci_address, s.fabric_vf_pci_address) for s in task.slots)
        if not asked:
            raise PermanentError("binding_refused", f"binding {task.task_id} names no GPU or fabric VF")
        topology = await discover(self.ctx.host, self.ctx.node_id, ovs_bridge=self.gpu_bridge)
        refused = refused_devices(
            asked, [g.pci_address for g in topology.gpus], [f.pci_address for f in topology.fabric if f.role == "vf"]
        )
        if refused:
            log.warning("vfio_binding_refused", task_id=task.task_id, refused=refused)
            raise PermanentError("binding_refused", "; ".join(refused)[:2000])
        try:
            await enter_slice_mode(self.ctx.host, asked)
        except driverctl.DriverctlError as exc:
            # The host may be half-bound now: parity says which devices, and the scheduler's set stays the last
            # one that was applied.
            await self.evidence.report_parity(task_id=task.task_id)
            raise PermanentError("binding_failed", str(exc)[:2000]) from exc
        self.ctx.store.set_approved_slots(task.task_id, "bind", [s.model_dump(mode="json") for s in task.slots])

    async def _unbind(self, task: m.SliceVfioApply) -> None:
        approved = self.ctx.store.approved_slots()
        release = release_set(((s.gpu_pci_address, s.fabric_vf_pci_address) for s in task.slots), approved)
        if not release:
            raise PermanentError(
                "binding_refused", f"unbind {task.task_id} names no device of this host's approved binding"
            )
        overrides = await driverctl.list_overrides(self.ctx.host)
        for bdf in release:
            if overrides.get(bdf) == VFIO_DRIVER:
                await driverctl.unset_override(self.ctx.host, bdf)
        gone = set(release)
        kept = [s for s in approved if not any(d in gone for d in slot_pairs([s])[0] if d)]
        self.ctx.store.set_approved_slots(task.task_id, "unbind", kept)
