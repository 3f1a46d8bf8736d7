"""An instant simulated slice host, for benchmarks of the control plane only.

It answers provision, release and image prewarm tasks at once, without disks, libvirt or DHCP, so a benchmark
measures the services and the bus rather than qemu-img and zero-fill on a 2-core machine. Its wipe
proofs say `method="simulated-instant"`, never a real method, its parity check is named
`simulated_instant_host`, and it runs only in a simulated fleet.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from gpuaas_common.bus import HandlerContext
from gpuaas_common.contract import TaskType, derived_event_id, utcnow
from gpuaas_common.contract import messages as m
from gpuaas_common.fleet import FleetNode

from .dhcp_guest import SIM_DRIVER_VERSION

Publish = Callable[..., Awaitable[Any]]
SIM_HUGEPAGES_1G = 512


class InstantSliceHost:
    def __init__(self, node_id: str, publish: Publish) -> None:
        self.node_id = node_id
        self.publish = publish

    async def on_prewarm(self, ctx: HandlerContext) -> None:
        """Its cache holds every image at the catalog digest: a slice image passes the activation gate only once
        every slice host verified it, so a fleet of instant hosts must answer the gate's prewarm tasks."""
        task = ctx.payload
        report = m.NodeImageCacheReported(
            task_id=task.task_id,
            node_id=self.node_id,
            slug=task.slug,
            status="verified",
            expected_digest=task.digest_sha256,
            digest_sha256=task.digest_sha256,
            local_path=task.image_path,
        )
        await self.publish(
            "node.image_cache_reported",
            report,
            correlation_id=task.task_id,
            causation_id=ctx.envelope.event_id,
            event_id=derived_event_id(task.task_id, f"cache:verified:{task.digest_sha256}"),
            node_id=self.node_id,
        )

    async def on_task(self, ctx: HandlerContext) -> None:
        task = ctx.payload
        common = dict(
            task_id=task.task_id,
            allocation_id=task.allocation_id,
            node_id=self.node_id,
            task_type=ctx.envelope.type,
            status="succeeded",
        )
        if ctx.envelope.type == TaskType.SLICE_VM_PROVISION:
            primary = task.slots[0]
            gpus = sum(1 for s in task.slots if s.gpu_pci_address)
            result = m.NodeTaskResult(
                **common,
                readiness=m.Readiness(
                    mac=primary.mac,
                    expected_ip=primary.private_ip,
                    actual_ip=primary.private_ip,
                    lease_state="bound",
                    ssh_ready=True,
                    # Its guests see every GPU they were given, as a passing agent's check records it.
                    guest_gpus=m.GuestGpus(
                        expected=gpus,
                        pci=gpus,
                        driver=gpus,
                        driver_state="loaded",
                        driver_version=SIM_DRIVER_VERSION,
                        driver_strategy=task.image.driver_strategy,
                    ),
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

    async def report_host_state(self, node: FleetNode) -> None:
        """Topology and parity evidence for a host that has no host tree to discover or check: the fleet
        file's slot bundles are reported as what discovery found (disks clean and unmounted, since there is
        no disk), and the one parity check says it is simulated. The scheduler still records them as
        evidence and ops (or the dev stack, as `gpuaas-dev`) still approve the candidates."""
        now = utcnow()
        topology = m.NodeTopologyReported(
            node_id=self.node_id,
            discovered_at=now,
            # The tuned host the simulated fleet models (fixture_host.xe9680l): 512 pages staged, all free.
            hugepages_1g_total=SIM_HUGEPAGES_1G,
            hugepages_1g_free=SIM_HUGEPAGES_1G,
            gpus=[
                m.GpuDevice(pci_address=s.gpu_pci_address, vendor_id="10de", device_id="2335", numa_node=s.numa_node)
                for s in node.slots
            ],
            nvme=[
                m.NvmeDevice(
                    kernel_name=f"nvme{i}n1",
                    by_id=s.nvme_by_id,
                    size_bytes=0,
                    numa_node=s.numa_node,
                    mounted=False,
                    is_os_disk=False,
                    signatures=[],
                    candidate=True,
                )
                for i, s in enumerate(node.slots)
            ],
            candidate_slots=[
                m.CandidateSlot(
                    index=i,
                    gpu_pci_address=s.gpu_pci_address,
                    numa_node=s.numa_node,
                    pcie_switch=s.pcie_switch,
                    nvme_by_id=s.nvme_by_id,
                    fabric_vf_pci_address=s.fabric_vf_pci_address,
                    mac=s.mac,
                    private_ip=s.private_ip,
                    ovs_bridge=s.ovs_bridge,
                    ovs_port=f"gpuaas-s{i}",
                    complete=True,
                )
                for i, s in enumerate(node.slots)
            ],
        )
        parity = m.NodeParityReported(
            node_id=self.node_id,
            checked_at=now,
            checks=[
                m.ParityCheck(
                    check="simulated_instant_host",
                    status="PASS",
                    detail="instant simulated host (benchmarks only): there is no host to check",
                )
            ],
            failures=0,
            warnings=0,
        )
        for type_, payload in (("node.topology_reported", topology), ("node.parity_reported", parity)):
            await self.publish(type_, payload, correlation_id=self.node_id, node_id=self.node_id)
