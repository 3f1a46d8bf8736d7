"""slice.slot_wipe: the scheduler asks the host to wipe the disks of slots no tenant holds (a host back from a
baremetal tenancy, a re-approval, a repair of a cleanup_blocked slot). Each disk is re-checked first and refused
while a live allocation of this host leases it; the outcomes go out on the host's own report subject
(node.slot_wipe_reported), which only this host's identity may publish: the scheduler frees a slot on nothing else."""

from __future__ import annotations

import asyncio

from gpuaas_common.bus import HandlerContext, PermanentError
from gpuaas_common.contract import TaskType, derived_event_id, utcnow
from gpuaas_common.contract import messages as m

from ...adapters import disk
from .context import HostContext, Refused, log
from .disks import check_disk, wipe_proof


class SlotWiper:
    def __init__(self, ctx: HostContext) -> None:
        self.ctx = ctx

    async def on_slot_wipe(self, ctx: HandlerContext) -> None:
        task: m.SliceSlotWipe = ctx.payload
        if task.node_id != self.ctx.node_id:
            raise PermanentError("schema_invalid", f"task for {task.node_id} delivered to {self.ctx.node_id}")
        if task.deadline <= utcnow():
            log.warning("task_refused", task_id=task.task_id, reason_code="deadline_passed")
            return
        self.ctx.store.start_task(task.task_id, TaskType.SLICE_SLOT_WIPE, "")
        async with asyncio.timeout((task.deadline - utcnow()).total_seconds()):
            outcomes = [await self._wipe_slot(s) for s in task.slots]
        report = m.NodeSlotWipeReported(task_id=task.task_id, node_id=self.ctx.node_id, outcomes=outcomes)
        # A redelivery wipes again (harmless on a disk nobody holds); its report's event id is the same.
        await self.ctx.publish(
            "node.slot_wipe_reported",
            report,
            correlation_id=task.task_id,
            event_id=derived_event_id(task.task_id, "node.slot_wipe_reported"),
            node_id=self.ctx.node_id,
        )
        proven = sum(1 for o in outcomes if o.proof is not None and o.proof.verified)
        self.ctx.store.finish_task(task.task_id, "succeeded", {"slots": len(outcomes), "proven": proven})
        log.info("slot_wipe_reported", task_id=task.task_id, slots=len(outcomes), proven=proven)

    async def _wipe_slot(self, slot: m.WipeSlot) -> m.SlotWipeOutcome:
        def refused(code: str, reason: str) -> m.SlotWipeOutcome:
            log.warning("slot_wipe_refused", slot_id=slot.slot_id, reason_code=code, reason=reason)
            return m.SlotWipeOutcome(
                slot_id=slot.slot_id, device=slot.nvme_by_id, reason_code=code, reason=reason[:2000]
            )

        if f"nvme:{slot.nvme_by_id}" in self.ctx.store.leased_resources():
            return refused("disk_leased", f"{slot.nvme_by_id} is leased by a live allocation of this host")
        try:
            path = check_disk(self.ctx.host, slot.nvme_by_id)
            proof = await disk.wipe_and_verify(str(path), slot.wipe_policy)
        except Refused as exc:
            return refused(exc.code, exc.reason)
        except Exception as exc:  # noqa: BLE001 - any failure is this slot's outcome, reported, never a proof
            return refused("wipe_error", f"{type(exc).__name__}: {exc}")
        return m.SlotWipeOutcome(
            slot_id=slot.slot_id,
            device=slot.nvme_by_id,
            proof=wipe_proof(slot.nvme_by_id, proof),
        )
