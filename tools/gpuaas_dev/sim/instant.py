"""An instant simulated slice host, for benchmarks of the control plane only.

It answers provision and release tasks at once, without disks, libvirt or DHCP, so a benchmark
measures the services and the bus rather than qemu-img and zero-fill on a 2-core machine. Its wipe
proofs say `method="simulated-instant"`, never a real method, and it runs only in a simulated fleet.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from gpuaas_common.bus import HandlerContext
from gpuaas_common.contract import derived_event_id
from gpuaas_common.contract import messages as m

Publish = Callable[..., Awaitable[Any]]


class InstantSliceHost:
    def __init__(self, node_id: str, publish: Publish) -> None:
        self.node_id = node_id
        self.publish = publish

    async def on_task(self, ctx: HandlerContext) -> None:
        task = ctx.payload
        common = dict(
            task_id=task.task_id,
            allocation_id=task.allocation_id,
            node_id=self.node_id,
            task_type=ctx.envelope.type,
            status="succeeded",
        )
        if ctx.envelope.type == "slice.vm_provision":
            primary = task.slots[0]
            result = m.NodeTaskResult(
                **common,
                readiness=m.Readiness(
                    mac=primary.mac,
                    expected_ip=primary.private_ip,
                    actual_ip=primary.private_ip,
                    lease_state="bound",
                    ssh_ready=True,
                ),
            )
        else:
            result = m.NodeTaskResult(
                **common,
                wipe_proofs=[
                    m.WipeProof(
                        device=s.nvme_by_id,
                        method="simulated-instant",
                        verified=True,
                        detail="instant simulated host: there is no disk to wipe",
                    )
                    for s in task.slots
                ],
            )
        await self.publish(
            "node.task_result",
            result,
            correlation_id=str(task.allocation_id),
            causation_id=ctx.envelope.event_id,
            event_id=derived_event_id(task.task_id, "result"),
            node_id=self.node_id,
        )
