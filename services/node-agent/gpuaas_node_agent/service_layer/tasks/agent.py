"""The slice host agent: the task objects of one host assembled, behind the methods the entrypoint and the tests
call. It holds no behaviour of its own."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gpuaas_common.bus import HandlerContext
from gpuaas_common.bus_dispatch import HeldDeadLetters
from gpuaas_common.contract import messages as m

from ...adapters.fabric_manager import FabricManager
from ...adapters.libvirt_host import LibvirtHost
from ...adapters.state_store import StateStore
from ..host_paths import HostPaths
from .context import GuestLogin, HostContext, Publish, TaskLocks
from .drift import Drift
from .evidence import HostEvidence
from .nvlink import NvlinkPartitions
from .provision import ProvisionTask
from .reconciler import HostReconciler
from .recovery import TaskRecovery
from .release import ReleaseTask
from .runner import TaskRunner
from .slot_wipe import SlotWiper
from .vfio import VfioBinding


class SliceHostAgent:
    """Provision and release tasks (provision.py, release.py) run through runner.py; recovery.py finishes what
    a previous run left half-done; reconciler.py holds the host against the records; evidence.py reports topology
    and parity; vfio.py binds the approved devices; slot_wipe.py wipes the disks of slots no tenant holds when
    the scheduler asks.

    `held_dead_letters`: the host bus's, counted in each drift report. `gpu_bridge`, `emulated_slot_disks` and
    `require_bf3_management`: what discovery and parity look at (evidence.py). `fabric_manager`: the host's
    Fabric Manager, made from the host tree on first use when none is given."""

    def __init__(
        self,
        node_id: str,
        paths: HostPaths,
        store: StateStore,
        libvirt: LibvirtHost,
        publish: Publish,
        *,
        hostsdir: str,
        lease_file: str,
        seed_dir: str,
        ssh_port: int,
        readiness_timeout_s: float,
        shutdown_timeout_s: float,
        relay_public_key: str | None = None,
        bridge_cidr: str = "10.100.0.1/24",
        domain_type: str = "kvm",
        bridge_kind: str = "openvswitch",
        guest_user: str = "gpuaas",
        console_user: str = "gpuaas-console",
        readiness_key: tuple[Path, str] | None = None,
        guest_login: GuestLogin | None = None,
        held_dead_letters: HeldDeadLetters | None = None,
        gpu_bridge: str = "ovsbr0",
        emulated_slot_disks: tuple[str, ...] = (),
        require_bf3_management: bool = False,
        fabric_manager: FabricManager | None = None,
    ) -> None:
        ctx = HostContext.on(
            node_id, paths, store, libvirt, publish, hostsdir=hostsdir, lease_file=lease_file, seed_dir=seed_dir
        )
        self.context = ctx
        self.locks = TaskLocks()
        self.nvlink = NvlinkPartitions(ctx.host, ctx.seed_dir, fabric_manager)
        self.provision = ProvisionTask(
            ctx,
            self.nvlink,
            ssh_port=ssh_port,
            readiness_timeout_s=readiness_timeout_s,
            relay_public_key=relay_public_key,
            domain_type=domain_type,
            bridge_kind=bridge_kind,
            guest_user=guest_user,
            console_user=console_user,
            readiness_key=readiness_key,
            guest_login=guest_login,
        )
        self.release = ReleaseTask(ctx, self.nvlink, shutdown_timeout_s=shutdown_timeout_s)
        self.runner = TaskRunner(ctx, self.locks, self.nvlink, self.provision, self.release)
        self.reconciler = HostReconciler(ctx, self.locks, self.nvlink, held_dead_letters=held_dead_letters)
        self.recovery = TaskRecovery(store, self.runner, self.reconciler)
        self.evidence = HostEvidence(
            ctx,
            bridge_cidr=bridge_cidr,
            gpu_bridge=gpu_bridge,
            emulated_slot_disks=emulated_slot_disks,
            require_bf3_management=require_bf3_management,
        )
        self.vfio = VfioBinding(ctx, self.evidence, gpu_bridge=gpu_bridge)
        self.slot_wiper = SlotWiper(ctx)

    # --- what tests read of the host ------------------------------------------------------------------

    @property
    def node_id(self) -> str:
        return self.context.node_id

    @property
    def store(self) -> StateStore:
        return self.context.store

    @property
    def libvirt(self) -> LibvirtHost:
        return self.context.libvirt

    @property
    def hostsdir(self) -> Path:
        return self.context.hostsdir

    # --- slice.vm_provision and slice.vm_release --------------------------------------------------------

    async def on_task(self, ctx: HandlerContext) -> None:
        await self.runner.on_task(ctx)

    async def execute(self, task_type: str, task: Any, *, causation_id: str | None = None) -> m.NodeTaskResult:
        return await self.runner.execute(task_type, task, causation_id=causation_id)

    async def run(self, task_type: str, task: Any) -> m.NodeTaskResult:
        return await self.runner.run(task_type, task)

    # --- start-up and reconciliation ------------------------------------------------------------------

    async def recover(self) -> list[m.NodeTaskResult]:
        return await self.recovery.recover()

    async def reconcile_host(self) -> list[Drift]:
        return await self.reconciler.reconcile_host()

    async def reconcile_domains(self) -> None:
        await self.reconciler.reconcile_domains()

    async def report_drift(self) -> list[Drift]:
        return await self.reconciler.report_drift()

    async def reconcile_periodically(self, interval_s: float) -> None:
        await self.reconciler.reconcile_periodically(interval_s)

    # --- evidence, binding and slot wipes ---------------------------------------------------------------

    async def report_host_state(
        self, *, task_id: str | None = None
    ) -> tuple[m.NodeTopologyReported, m.NodeParityReported]:
        return await self.evidence.report_host_state(task_id=task_id)

    async def report_parity(self, *, task_id: str | None = None) -> m.NodeParityReported:
        return await self.evidence.report_parity(task_id=task_id)

    async def on_discover(self, ctx: HandlerContext) -> None:
        await self.evidence.on_discover(ctx)

    async def on_parity_check(self, ctx: HandlerContext) -> None:
        await self.evidence.on_parity_check(ctx)

    async def on_vfio_apply(self, ctx: HandlerContext) -> None:
        await self.vfio.on_vfio_apply(ctx)

    async def on_slot_wipe(self, ctx: HandlerContext) -> None:
        await self.slot_wiper.on_slot_wipe(ctx)
