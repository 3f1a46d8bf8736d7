"""Readiness evidence: topology discovery and the parity checks, published on request
(slice.topology_discover: both; slice.parity_check: parity alone) and at start-up."""

from __future__ import annotations

import asyncio

from gpuaas_common.bus import HandlerContext, PermanentError
from gpuaas_common.contract import TaskType, derived_event_id, utcnow
from gpuaas_common.contract import messages as m

from ...adapters.discovery import discover
from ...adapters.parity import ParityChecker
from .context import HostContext, log


def evidence_task_due(node_id: str, task: m.SliceTopologyDiscover | m.SliceParityCheck | m.SliceVfioApply) -> bool:
    if task.node_id != node_id:
        raise PermanentError("schema_invalid", f"task for {task.node_id} delivered to {node_id}")
    if task.deadline <= utcnow():
        log.warning("task_refused", task_id=task.task_id, reason_code="deadline_passed")
        return False
    return True


class HostEvidence:
    """What discovery and parity look at besides the host itself: the GPU bridge by name and its address, the
    disks the site declared as emulated slots (a lab host; none on a GPU host), and whether the BF3's management
    interface is required."""

    def __init__(
        self,
        ctx: HostContext,
        *,
        bridge_cidr: str = "10.100.0.1/24",
        gpu_bridge: str = "ovsbr0",
        emulated_slot_disks: tuple[str, ...] = (),
        require_bf3_management: bool = False,
    ) -> None:
        self.ctx = ctx
        self.bridge_cidr = bridge_cidr
        self.gpu_bridge = gpu_bridge
        self.emulated_slot_disks = emulated_slot_disks
        self.require_bf3_management = require_bf3_management

    async def report_host_state(
        self, *, task_id: str | None = None
    ) -> tuple[m.NodeTopologyReported, m.NodeParityReported]:
        """Discover topology and run the parity checks; publish both as readiness evidence."""
        topology, parity = await self.host_state(task_id)
        for type_, payload in (("node.topology_reported", topology), ("node.parity_reported", parity)):
            await self._report(type_, payload, task_id)
        return topology, parity

    async def report_parity(self, *, task_id: str | None = None) -> m.NodeParityReported:
        """The parity checks alone: an operator's or the scheduler's periodic ask must not replace the candidates
        ops are approving from (a topology report would)."""
        _, parity = await self.host_state(task_id)
        await self._report("node.parity_reported", parity, task_id)
        return parity

    async def _report(self, type_: str, payload: m.Payload, task_id: str | None) -> None:
        await self.ctx.publish(
            type_,
            payload,
            correlation_id=task_id or self.ctx.node_id,
            event_id=derived_event_id(task_id, type_) if task_id else None,
            node_id=self.ctx.node_id,
        )

    async def host_state(self, task_id: str | None) -> tuple[m.NodeTopologyReported, m.NodeParityReported]:
        leased = [r.removeprefix("nvme:") for r in self.ctx.store.leased_resources() if r.startswith("nvme:")]
        topology = await discover(
            self.ctx.host,
            self.ctx.node_id,
            task_id=task_id,
            ovs_bridge=self.gpu_bridge,
            leased_by_id=leased,
            emulated_disks=self.emulated_slot_disks,
        )
        parity = await ParityChecker(
            self.ctx.host,
            bridge=self.gpu_bridge,
            bridge_cidr=self.bridge_cidr,
            agent_running=True,
            topology=topology,
            emulated=bool(self.emulated_slot_disks),
            libvirt_alive=self.libvirt_alive,
            require_bf3_management=self.require_bf3_management,
            approved_slots=self.ctx.store.approved_slots(),
            released=self.ctx.store.binding_released(),
        ).run(self.ctx.node_id, task_id=task_id)
        return topology, parity

    async def libvirt_alive(self) -> bool:
        """The hypervisor answers on the agent's own connection: behaviour, where a unit name says only how it
        was started (the lab's libvirtd is no systemd unit)."""
        try:
            await self.ctx.libvirt.list_domains()
        except Exception:  # any refusal of the connection is the answer
            return False
        return True

    async def on_discover(self, ctx: HandlerContext) -> None:
        task: m.SliceTopologyDiscover = ctx.payload
        if not evidence_task_due(self.ctx.node_id, task):
            return
        # Read-only and cheap: a redelivery simply discovers again; the event ids derive from the task id,
        # so JetStream drops the repeat within its duplicate window.
        self.ctx.store.start_task(task.task_id, TaskType.SLICE_TOPOLOGY_DISCOVER, "")
        async with asyncio.timeout((task.deadline - utcnow()).total_seconds()):
            topology, parity = await self.report_host_state(task_id=task.task_id)
        self.ctx.store.finish_task(
            task.task_id, "succeeded", {"candidates": len(topology.candidate_slots), "parity_failures": parity.failures}
        )

    async def on_parity_check(self, ctx: HandlerContext) -> None:
        task: m.SliceParityCheck = ctx.payload
        if not evidence_task_due(self.ctx.node_id, task):
            return
        # Read-only like discovery: a redelivery checks again and its report's event id is the same.
        self.ctx.store.start_task(task.task_id, TaskType.SLICE_PARITY_CHECK, "")
        async with asyncio.timeout((task.deadline - utcnow()).total_seconds()):
            parity = await self.report_parity(task_id=task.task_id)
        self.ctx.store.finish_task(task.task_id, "succeeded", {"parity_failures": parity.failures})
