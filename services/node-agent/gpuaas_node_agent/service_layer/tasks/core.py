"""What every slice task shares: the agent's wiring, the refusal and failure exceptions, the phase and
result messages, and the disk identity check both provision and release run before touching a disk."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from gpuaas_common.bus_dispatch import HeldDeadLetters
from gpuaas_common.contract import derived_event_id
from gpuaas_common.contract import messages as m
from gpuaas_common.logging import get_logger

from ...adapters.discovery import block_use
from ...adapters.guest_ssh import LoginOutcome
from ...adapters.host import Host
from ...adapters.libvirt_host import LibvirtHost
from ...adapters.state_store import StateStore
from ..host_paths import HostPaths

log = get_logger("gpuaas_node_agent.service_layer.tasks")  # one logger name for the whole task runner

PROGRESS_PUBLISH_TIMEOUT_S = 1.0

Publish = Callable[..., Awaitable[Any]]
GuestLogin = Callable[[str], Awaitable[LoginOutcome]]


class Refused(Exception):
    def __init__(self, code: str, reason: str) -> None:
        super().__init__(reason)
        self.code = code
        self.reason = reason


class TaskFailed(Exception):
    def __init__(self, code: str, reason: str) -> None:
        super().__init__(reason)
        self.code = code
        self.reason = reason


class AgentCore:
    def __init__(
        self,
        node_id: str,
        paths: HostPaths,
        store: StateStore,
        libvirt: LibvirtHost,
        publish: Publish,
        *,
        image_cache_dir: str,
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
    ) -> None:
        self.node_id = node_id
        # The host bus's dead letters, kept at home; their count goes out with each drift report.
        self.held_dead_letters: HeldDeadLetters | None = None
        self.domain_type = domain_type
        self.bridge_kind = bridge_kind
        self.guest_user = guest_user
        # The guest user the terminal relay key is authorised for: no sudo, not the tenant's login.
        self.console_user = console_user
        # The agent's login key (path, public line): with it readiness is a real login against the host key the
        # seed planted; without it (the simulated fleet, whose guests are not machines) an SSH banner only.
        self.readiness_key = readiness_key
        # The simulated fleet's stand-in for that login: its guests answer with the GPU report a real one writes.
        # With neither, readiness is the banner and the guest's GPUs go unchecked (an agent whose guests are
        # simulated by another process, which only tests run).
        self.guest_login = guest_login
        self.bridge_cidr = bridge_cidr
        self.paths = paths
        self.store = store
        self.libvirt = libvirt
        self.publish = publish
        self.image_cache_dir = image_cache_dir
        self.hostsdir = paths.host(hostsdir)
        self.lease_file = paths.host(lease_file)
        self.seed_dir = paths.host(seed_dir)
        self.ssh_port = ssh_port
        self.readiness_timeout_s = readiness_timeout_s
        self.shutdown_timeout_s = shutdown_timeout_s
        self.relay_public_key = relay_public_key
        self.host = Host.at(paths.root)
        # Tasks on disjoint slots run in parallel, as on a real host; two tasks that share a slot never
        # interleave. Locks are taken in sorted order so two multi-slot tasks cannot deadlock.
        self._slot_locks: dict[str, asyncio.Lock] = {}
        # Held by the task working on a VM, so the periodic reconciler never acts on a VM mid-task.
        self._vm_locks: dict[str, asyncio.Lock] = {}

    def _result(
        self,
        task: Any,
        task_type: str,
        status: str,
        *,
        code: str | None = None,
        reason: str | None = None,
        cleanup_required: bool = False,
        readiness_: m.Readiness | None = None,
        proofs: list[m.WipeProof] | None = None,
        stop_path: str | None = None,
    ) -> m.NodeTaskResult:
        # A release follows a VM that had its disks, so only a provision can say it never wrote one, and only
        # from the record `_phase` writes before the first write.
        record = self.store.task(task.task_id)
        touched = task_type != "slice.vm_provision" or bool(record and record["disk_touched"])
        return m.NodeTaskResult(
            task_id=task.task_id,
            allocation_id=task.allocation_id,
            node_id=self.node_id,
            task_type=task_type,
            status=status,
            reason_code=code,
            reason=reason,
            readiness=readiness_,
            wipe_proofs=proofs or [],
            cleanup_required=cleanup_required,
            disk_touched=touched,
            stop_path=stop_path,  # type: ignore[arg-type]  # ShutdownPath's values, checked by the contract
        )

    async def _phase(
        self, task: Any, task_type: str, phase: str, *, disk_touched: bool = False, detail: str | None = None
    ) -> None:
        self.store.set_phase(task.task_id, phase, disk_touched=disk_touched)
        log.info("task_phase", task_id=task.task_id, allocation_id=str(task.allocation_id), phase=phase, detail=detail)
        try:
            await self._publish_progress(task, task_type, phase, detail)
        except Exception as exc:  # noqa: BLE001 - progress is for people watching; the result is what counts
            # E.g. a JetStream publish timing out while the stream elects a new leader: the task goes on.
            log.warning("task_progress_not_published", task_id=task.task_id, phase=phase, error=repr(exc))

    async def _publish_progress(self, task: Any, task_type: str, phase: str, detail: str | None) -> None:
        await self.publish(
            "node.task_progress",
            m.NodeTaskProgress(
                task_id=task.task_id,
                allocation_id=task.allocation_id,
                node_id=self.node_id,
                task_type=task_type,
                phase=phase,
                detail=detail,
            ),
            correlation_id=str(task.allocation_id),
            event_id=derived_event_id(task.task_id, f"phase:{phase}"),
            # Progress is for people watching. While a stream elects a new leader after a NATS server died
            # (4-9 s), a publish gets no PubAck: at the usual 5 s each phase of the task waited that long
            # (a chaos run saw tasks held up ~15 s); at 1 s the task goes on, and only its result waits for a PubAck.
            timeout=PROGRESS_PUBLISH_TIMEOUT_S,
            node_id=self.node_id,
        )

    def _check_disk(self, by_id: str) -> Path:
        """The disk behind a stable by-id link, refused unless it is a whole, unmounted, unheld NVMe disk that is
        not the OS disk (children checked one by one: a lab wipe once hit a disk whose partition was mounted)."""
        fs = self.host.fs
        if not by_id.startswith("/dev/disk/by-id/"):
            raise Refused("disk_identity_unstable", f"{by_id} is not a /dev/disk/by-id path")
        if not fs.exists(by_id):
            raise Refused("disk_missing", f"{by_id} does not resolve on this host")
        real = fs.realpath(by_id)
        if not real.startswith("/dev/") or real.count("/") != 2:
            raise Refused("disk_missing", f"{by_id} resolves to {real}, not a device node")
        use = block_use(fs, real.rsplit("/", 1)[-1])
        refusal = use.refusal()
        if refusal:
            raise Refused(refusal[0], f"{by_id}: {refusal[1]}")
        return fs.agent_path(by_id)
