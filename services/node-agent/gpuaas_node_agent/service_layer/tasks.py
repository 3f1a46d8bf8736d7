"""Node tasks: one task message in, host work done in phases, one result out.

Idempotent per task id through the local state store; a stale fencing epoch or a resource leased to
another allocation is refused before anything destructive runs; any failure after the disk was
touched is reported with `cleanup_required` so the scheduler never hands the slot out unwiped.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from gpuaas_common.bus import HandlerContext, PermanentError
from gpuaas_common.contract import derived_event_id, utcnow
from gpuaas_common.contract import messages as m
from gpuaas_common.logging import get_logger

from ..adapters import disk, dnsmasq, readiness, seed_iso
from ..adapters.libvirt_host import LibvirtHost
from ..adapters.state_store import StateStore
from ..domain.domain_xml import render_domain_xml
from ..domain.profiles import vm_resources
from ..domain.vm_spec import SliceVmSpec
from .host_paths import HostPaths

log = get_logger(__name__)

Publish = Callable[..., Awaitable[Any]]


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


class SliceHostAgent:
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
    ) -> None:
        self.node_id = node_id
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
        # Tasks on disjoint slots run in parallel, as on a real host; two tasks that share a slot never
        # interleave. Locks are taken in sorted order so two multi-slot tasks cannot deadlock.
        self._slot_locks: dict[str, asyncio.Lock] = {}

    # --- bus entry ----------------------------------------------------------------------------

    async def on_task(self, ctx: HandlerContext) -> None:
        task = ctx.payload
        if task.node_id != self.node_id:
            raise PermanentError("schema_invalid", f"task for {task.node_id} delivered to {self.node_id}")
        async with contextlib.AsyncExitStack() as stack:
            for slot_id in sorted(s.slot_id for s in task.slots):
                await stack.enter_async_context(self._slot_locks.setdefault(slot_id, asyncio.Lock()))
            result = await self.run(ctx.envelope.type, task)
        await self.publish(
            "node.task_result", result, correlation_id=str(task.allocation_id), causation_id=ctx.envelope.event_id,
            event_id=derived_event_id(task.task_id, "result"), node_id=self.node_id,
        )

    async def run(self, task_type: str, task: Any) -> m.NodeTaskResult:
        record = self.store.task(task.task_id)
        if record and record["status"] != "running" and record["result"]:
            log.info("task_replayed", task_id=task.task_id, status=record["status"])
            return m.NodeTaskResult.model_validate(record["result"])
        interrupted_after_disk = bool(record and record["status"] == "running" and record["disk_touched"])
        self.store.start_task(task.task_id, task_type, str(task.allocation_id))
        try:
            if interrupted_after_disk:
                raise TaskFailed("interrupted", "agent restarted while the task was running after the disk was touched")
            if task.deadline <= utcnow():
                raise Refused("deadline_passed", f"task deadline {task.deadline.isoformat()} has passed")
            slot_ids = [s.slot_id for s in task.slots]
            stale = self.store.check_and_record_epochs(slot_ids, task.fencing_epoch)
            if stale:
                raise Refused("stale_epoch", stale)
            if task_type == "slice.vm_provision":
                result = await self._provision(task)
            elif task_type == "slice.vm_release":
                result = await self._release(task)
            else:
                raise Refused("unsupported_task", task_type)
        except Refused as exc:
            log.warning("task_refused", task_id=task.task_id, reason_code=exc.code, reason=exc.reason)
            if task_type == "slice.vm_provision":
                self.store.drop_leases(str(task.allocation_id))
            result = self._result(task, task_type, "refused", code=exc.code, reason=exc.reason)
        except TaskFailed as exc:
            record = self.store.task(task.task_id)
            touched = bool(record and record["disk_touched"])
            if not touched:
                self.store.drop_leases(str(task.allocation_id))
            log.error("task_failed", task_id=task.task_id, reason_code=exc.code, reason=exc.reason, cleanup_required=touched)
            result = self._result(task, task_type, "failed", code=exc.code, reason=exc.reason, cleanup_required=touched)
        self.store.finish_task(task.task_id, result.status, result.model_dump(mode="json"))
        return result

    def _result(self, task: Any, task_type: str, status: str, *, code: str | None = None, reason: str | None = None,
                cleanup_required: bool = False, readiness_: m.Readiness | None = None,
                proofs: list[m.WipeProof] | None = None) -> m.NodeTaskResult:
        return m.NodeTaskResult(
            task_id=task.task_id, allocation_id=task.allocation_id, node_id=self.node_id, task_type=task_type,
            status=status, reason_code=code, reason=reason, readiness=readiness_, wipe_proofs=proofs or [],
            cleanup_required=cleanup_required,
        )

    async def _phase(self, task: Any, task_type: str, phase: str, *, disk_touched: bool = False) -> None:
        self.store.set_phase(task.task_id, phase, disk_touched=disk_touched)
        log.info("task_phase", task_id=task.task_id, phase=phase)
        await self.publish(
            "node.task_progress",
            m.NodeTaskProgress(task_id=task.task_id, allocation_id=task.allocation_id, node_id=self.node_id,
                               task_type=task_type, phase=phase),
            correlation_id=str(task.allocation_id), event_id=derived_event_id(task.task_id, f"phase:{phase}"),
            node_id=self.node_id,
        )

    # --- provisioning ----------------------------------------------------------------------------

    async def _verify_image(self, image: m.ImageRef) -> Path:
        path = self.paths.host(image.image_path)
        try:
            st = path.stat()
        except FileNotFoundError:
            raise Refused("image_not_cached", f"image {image.slug} is not in the node cache at {image.image_path}") from None
        cached = self.store.verified_digest(str(path), st.st_size, st.st_mtime)
        digest = cached or await asyncio.to_thread(_sha256_file, path)
        if digest != image.digest_sha256:
            raise Refused("image_unverified", f"cached {image.slug} has digest {digest}, expected {image.digest_sha256}")
        if not cached:
            self.store.remember_digest(str(path), digest, st.st_size, st.st_mtime)
        return path

    def _check_disk(self, by_id: str) -> Path:
        path = self.paths.host(by_id)
        if not path.exists():
            raise Refused("disk_missing", f"{by_id} does not resolve on this host")
        mounts = self.paths.host("/proc/mounts")
        if mounts.exists():
            target = str(path.resolve())
            for line in mounts.read_text().splitlines():
                fields = line.split()
                if fields and fields[0] in (by_id, target):
                    raise Refused("disk_mounted", f"{by_id} is mounted at {fields[1]}")
        return path

    async def _provision(self, task: m.SliceVmProvision) -> m.NodeTaskResult:
        t = "slice.vm_provision"
        await self._phase(task, t, "preflight")
        image_path = await self._verify_image(task.image)
        disks = [self._check_disk(s.nvme_by_id) for s in task.slots]
        resources = [f"gpu:{s.gpu_pci_address}" for s in task.slots] + [f"nvme:{s.nvme_by_id}" for s in task.slots]
        resources += [f"vf:{s.fabric_vf_pci_address}" for s in task.slots if s.fabric_vf_pci_address]
        conflict = self.store.take_leases(resources, str(task.allocation_id))
        if conflict:
            raise Refused("resource_leased", conflict)
        if await self.libvirt.exists(task.vm_name):
            raise Refused("domain_exists", f"a domain named {task.vm_name} is already defined")
        primary = task.slots[0]
        try:
            # The seed is rendered before the disk is touched: bad input must fail with nothing to clean.
            await self._phase(task, t, "seed")
            seed_path = self.seed_dir / f"{task.vm_name}.iso"
            keys = list(task.ssh_public_keys) + ([self.relay_public_key] if self.relay_public_key else [])
            try:
                await seed_iso.write_seed_iso(seed_path, instance_id=str(task.allocation_id), hostname=task.hostname,
                                              ssh_authorized_keys=keys)
            except seed_iso.SeedIsoError as exc:
                raise Refused("invalid_seed", str(exc)) from exc
            await self._phase(task, t, "clone_image", disk_touched=True)
            await disk.clone_image(str(image_path), "raw", str(disks[0]))
            await self._phase(task, t, "define")
            vcpus, memory_mib, hugepages = vm_resources(primary.profile, len(task.slots))
            spec = SliceVmSpec(
                vm_name=task.vm_name, uuid=str(uuid.uuid5(uuid.NAMESPACE_URL, str(task.allocation_id))),
                vcpus=vcpus, memory_mib=memory_mib, hugepages=hugepages, numa_node=primary.numa_node,
                gpus=[s.gpu_pci_address for s in task.slots],
                fabric_vfs=[s.fabric_vf_pci_address for s in task.slots if s.fabric_vf_pci_address],
                nvme_by_id=[str(d) for d in disks], seed_iso_path=str(seed_path), mac=primary.mac,
                bridge=primary.ovs_bridge,
            )
            await self.libvirt.define_and_start(render_domain_xml(spec))
            await self._phase(task, t, "dhcp_reservation")
            dnsmasq.write_reservation(self.hostsdir, task.vm_name, primary.mac, primary.private_ip, task.hostname)
            await self._phase(task, t, "wait_ready")
            ready = await readiness.wait_ready(self.lease_file, primary.mac, primary.private_ip, self.ssh_port,
                                               self.readiness_timeout_s)
        except Refused:
            raise
        except Exception as exc:
            raise TaskFailed("provision_error", f"{type(exc).__name__}: {exc}") from exc
        if not (ready.ssh_ready and ready.lease_state == "bound"):
            raise TaskFailed("not_ready", f"lease {ready.lease_state}, ssh_ready={ready.ssh_ready}")
        readiness_ev = m.Readiness(mac=ready.mac, expected_ip=ready.expected_ip, actual_ip=ready.actual_ip,
                                   lease_state=ready.lease_state, ssh_ready=ready.ssh_ready)
        await self._phase(task, t, "ready")
        return self._result(task, t, "succeeded", readiness_=readiness_ev)

    # --- release ---------------------------------------------------------------------------------

    async def _release(self, task: m.SliceVmRelease) -> m.NodeTaskResult:
        t = "slice.vm_release"
        await self._phase(task, t, "stop")
        try:
            if await self.libvirt.exists(task.vm_name):
                await self.libvirt.shutdown(task.vm_name, self.shutdown_timeout_s)
                await self._phase(task, t, "undefine")
                await self.libvirt.undefine(task.vm_name)
            dnsmasq.remove_reservation(self.hostsdir, task.vm_name)
            seed = self.seed_dir / f"{task.vm_name}.iso"
            seed.unlink(missing_ok=True)
            await self._phase(task, t, "wipe", disk_touched=True)
            proofs = []
            for slot in task.slots:
                path = self._check_disk(slot.nvme_by_id)
                proof = await disk.wipe_and_verify(str(path))
                proofs.append(m.WipeProof(
                    device=slot.nvme_by_id, method=proof.method, verified=proof.verified,
                    signatures=[str(sig) for sig in proof.signatures], detail=proof.detail,
                ))
        except Refused:
            raise
        except Exception as exc:
            raise TaskFailed("release_error", f"{type(exc).__name__}: {exc}") from exc
        self.store.drop_leases(str(task.allocation_id))
        await self._phase(task, t, "released")
        return self._result(task, t, "succeeded", proofs=proofs)


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
