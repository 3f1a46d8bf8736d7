"""Node tasks: one task message in, host work done in phases, one result out.

Idempotent per task id through the local state store; a stale fencing epoch or a resource leased to
another allocation is refused before anything destructive runs; any failure after the disk was
touched is reported with `cleanup_required` so the scheduler never hands the slot out unwiped.
Every task runs within its deadline, and a task a killed agent left half-done is finished on restart:
rerun when nothing destructive had happened yet (or when it was a release), else reported failed
with cleanup — exactly one result either way.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from gpuaas_common.bus import HandlerContext, PermanentError
from gpuaas_common.contract import derived_event_id, utcnow
from gpuaas_common.contract import messages as m
from gpuaas_common.digests import sha256_file
from gpuaas_common.logging import get_logger

from ..adapters import disk, dnsmasq, readiness, seed_iso
from ..adapters.discovery import block_use, discover
from ..adapters.host import Host
from ..adapters.libvirt_host import LibvirtHost, LibvirtHostError
from ..adapters.parity import ParityChecker
from ..adapters.state_store import StateStore
from ..domain.domain_xml import render_domain_xml
from ..domain.profiles import vm_resources
from ..domain.vm_spec import SliceVmSpec
from .host_paths import HostPaths

log = get_logger(__name__)

HUGEPAGES_1G_FREE = "/sys/kernel/mm/hugepages/hugepages-1048576kB/free_hugepages"
SLICE_TASKS = ("slice.vm_provision", "slice.vm_release")
_TASK_MODELS: dict[str, type[m.Payload]] = {
    "slice.vm_provision": m.SliceVmProvision,
    "slice.vm_release": m.SliceVmRelease,
}

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
        self.host = Host.at(paths.root)
        # Tasks on disjoint slots run in parallel, as on a real host; two tasks that share a slot never
        # interleave. Locks are taken in sorted order so two multi-slot tasks cannot deadlock.
        self._slot_locks: dict[str, asyncio.Lock] = {}

    # --- bus entry ----------------------------------------------------------------------------

    async def on_task(self, ctx: HandlerContext) -> None:
        task = ctx.payload
        if task.node_id != self.node_id:
            raise PermanentError("schema_invalid", f"task for {task.node_id} delivered to {self.node_id}")
        await self.execute(ctx.envelope.type, task, causation_id=ctx.envelope.event_id)

    async def execute(self, task_type: str, task: Any, *, causation_id: str | None = None) -> m.NodeTaskResult:
        async with contextlib.AsyncExitStack() as stack:
            for slot_id in sorted(s.slot_id for s in task.slots):
                await stack.enter_async_context(self._slot_locks.setdefault(slot_id, asyncio.Lock()))
            result = await self.run(task_type, task)
        await self.publish(
            "node.task_result",
            result,
            correlation_id=str(task.allocation_id),
            causation_id=causation_id,
            event_id=derived_event_id(task.task_id, "result"),
            node_id=self.node_id,
        )
        return result

    async def run(self, task_type: str, task: Any) -> m.NodeTaskResult:
        record = self.store.task(task.task_id)
        if record and record["status"] != "running" and record["result"]:
            log.info(
                "task_replayed", task_id=task.task_id, allocation_id=str(task.allocation_id), status=record["status"]
            )
            return m.NodeTaskResult.model_validate(record["result"])
        # A provision interrupted after the disk was touched cannot be resumed blindly (the clone may be
        # half-written); a release can, because every one of its steps is idempotent.
        interrupted_after_disk = bool(
            record and record["status"] == "running" and record["disk_touched"] and task_type == "slice.vm_provision"
        )
        self.store.start_task(
            task.task_id, task_type, str(task.allocation_id), vm_name=task.vm_name, payload=task.model_dump(mode="json")
        )
        try:
            if interrupted_after_disk:
                raise TaskFailed("interrupted", "agent restarted while the task was running after the disk was touched")
            remaining = (task.deadline - utcnow()).total_seconds()
            if remaining <= 0:
                raise Refused("deadline_passed", f"task deadline {task.deadline.isoformat()} has passed")
            slot_ids = [s.slot_id for s in task.slots]
            stale = self.store.check_and_record_epochs(slot_ids, task.fencing_epoch)
            if stale:
                raise Refused("stale_epoch", stale)
            try:
                async with asyncio.timeout(remaining):
                    if task_type == "slice.vm_provision":
                        result = await self._provision(task)
                    elif task_type == "slice.vm_release":
                        result = await self._release(task)
                    else:
                        raise Refused("unsupported_task", task_type)
            except TimeoutError:
                raise TaskFailed(
                    "deadline_exceeded", f"task did not finish by its deadline {task.deadline.isoformat()}"
                ) from None
        except Refused as exc:
            log.warning(
                "task_refused",
                task_id=task.task_id,
                allocation_id=str(task.allocation_id),
                reason_code=exc.code,
                reason=exc.reason,
            )
            if task_type == "slice.vm_provision":
                self.store.drop_leases(str(task.allocation_id))
            # A release that refused to wipe a disk leaves tenant data on it: the slot still needs cleanup.
            unwiped = task_type == "slice.vm_release" and exc.code.startswith("disk_")
            result = self._result(
                task, task_type, "refused", code=exc.code, reason=exc.reason, cleanup_required=unwiped
            )
        except TaskFailed as exc:
            record = self.store.task(task.task_id)
            touched = bool(record and record["disk_touched"])
            if task_type == "slice.vm_provision":
                # Never leave a half-provisioned VM defined or running: it would hold the GPUs and the disk.
                await self._teardown_domain(task)
            if not touched:
                self.store.drop_leases(str(task.allocation_id))
            log.error(
                "task_failed",
                task_id=task.task_id,
                allocation_id=str(task.allocation_id),
                reason_code=exc.code,
                reason=exc.reason,
                cleanup_required=touched,
            )
            result = self._result(task, task_type, "failed", code=exc.code, reason=exc.reason, cleanup_required=touched)
        self.store.finish_task(task.task_id, result.status, result.model_dump(mode="json"))
        return result

    async def _teardown_domain(self, task: Any) -> None:
        try:
            if await self.libvirt.exists(task.vm_name):
                await self.libvirt.shutdown(task.vm_name, 0)
                await self.libvirt.undefine(task.vm_name)
                log.warning(
                    "libvirt_domain_torn_down",
                    task_id=task.task_id,
                    allocation_id=str(task.allocation_id),
                    domain=task.vm_name,
                )
            dnsmasq.remove_reservation(self.hostsdir, task.vm_name)
        except (LibvirtHostError, OSError) as exc:
            log.error("libvirt_domain_teardown_failed", task_id=task.task_id, domain=task.vm_name, error=str(exc))

    # --- start-up ---------------------------------------------------------------------------------

    async def recover(self) -> list[m.NodeTaskResult]:
        """Finish what a previous run left half-done, then bring libvirt in line with the task records."""
        results = []
        for record in self.store.running_tasks():
            model = _TASK_MODELS.get(record["task_type"])
            if model is None or record["payload"] is None:
                continue
            task = model.model_validate(record["payload"])
            log.warning(
                "task_recovering",
                task_id=task.task_id,
                allocation_id=str(task.allocation_id),
                task_type=record["task_type"],
                disk_touched=record["disk_touched"],
            )
            results.append(await self.execute(record["task_type"], task))
        await self.reconcile_domains()
        return results

    async def reconcile_domains(self) -> None:
        """A domain whose last task was a failed provision or a finished release must not exist: stop and
        undefine it. Domains the agent has no record of are reported and left alone (not ours to touch)."""
        latest = self.store.latest_by_vm()
        for dom in await self.libvirt.list_domains():
            record = latest.get(dom.name)
            if record is None:
                log.info("libvirt_domain_unmanaged", domain=dom.name, state=dom.state.value)
                continue
            task_type, status = record
            stale = (task_type == "slice.vm_provision" and status in ("failed", "refused")) or (
                task_type == "slice.vm_release" and status == "succeeded"
            )
            if stale:
                await self.libvirt.shutdown(dom.name, 0)
                await self.libvirt.undefine(dom.name)
                log.warning("libvirt_domain_reconciled", domain=dom.name, last_task=task_type, last_status=status)

    # --- topology and parity -----------------------------------------------------------------------

    async def report_host_state(
        self, *, task_id: str | None = None
    ) -> tuple[m.NodeTopologyReported, m.NodeParityReported]:
        """Discover topology and run the parity checks; publish both as readiness evidence."""
        leased = [r.removeprefix("nvme:") for r in self.store.leased_resources() if r.startswith("nvme:")]
        topology = await discover(self.host, self.node_id, task_id=task_id, leased_by_id=leased)
        parity = await ParityChecker(self.host, agent_running=True).run(self.node_id, task_id=task_id)
        for type_, payload in (("node.topology_reported", topology), ("node.parity_reported", parity)):
            await self.publish(
                type_,
                payload,
                correlation_id=task_id or self.node_id,
                event_id=derived_event_id(task_id, type_) if task_id else None,
                node_id=self.node_id,
            )
        return topology, parity

    async def on_discover(self, ctx: HandlerContext) -> None:
        task: m.SliceTopologyDiscover = ctx.payload
        if task.node_id != self.node_id:
            raise PermanentError("schema_invalid", f"task for {task.node_id} delivered to {self.node_id}")
        if task.deadline <= utcnow():
            log.warning("task_refused", task_id=task.task_id, reason_code="deadline_passed")
            return
        # Read-only and cheap: a redelivery simply discovers again; the event ids derive from the task id,
        # so JetStream drops the repeat within its duplicate window.
        self.store.start_task(task.task_id, "slice.topology_discover", "")
        async with asyncio.timeout((task.deadline - utcnow()).total_seconds()):
            topology, parity = await self.report_host_state(task_id=task.task_id)
        self.store.finish_task(
            task.task_id, "succeeded", {"candidates": len(topology.candidate_slots), "parity_failures": parity.failures}
        )

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
    ) -> m.NodeTaskResult:
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
        )

    async def _phase(
        self, task: Any, task_type: str, phase: str, *, disk_touched: bool = False, detail: str | None = None
    ) -> None:
        self.store.set_phase(task.task_id, phase, disk_touched=disk_touched)
        log.info("task_phase", task_id=task.task_id, allocation_id=str(task.allocation_id), phase=phase, detail=detail)
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
            node_id=self.node_id,
        )

    # --- provisioning ----------------------------------------------------------------------------

    async def _verify_image(self, image: m.ImageRef) -> Path:
        path = self.paths.host(image.image_path)
        try:
            st = path.stat()
        except FileNotFoundError:
            raise Refused(
                "image_not_cached", f"image {image.slug} is not in the node cache at {image.image_path}"
            ) from None
        cached = self.store.verified_digest(str(path), st.st_size, st.st_mtime)
        digest = cached or await asyncio.to_thread(sha256_file, path)
        if digest != image.digest_sha256:
            raise Refused(
                "image_unverified", f"cached {image.slug} has digest {digest}, expected {image.digest_sha256}"
            )
        if not cached:
            self.store.remember_digest(str(path), digest, st.st_size, st.st_mtime)
        return path

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

    async def _preflight_host(self, task: m.SliceVmProvision) -> None:
        fs = self.host.fs
        parity = ParityChecker(self.host)
        for check in (parity.kvm, parity.iommu_groups, parity.vfio_modules):
            result = await check()
            if result.status != "PASS":
                raise Refused("host_not_ready", f"{result.check}: {result.detail}")
        for bridge in sorted({s.ovs_bridge for s in task.slots}):
            if not fs.exists(f"/sys/class/net/{bridge}"):
                raise Refused("ovs_bridge_missing", f"OVS bridge {bridge} does not exist on this host")
        for slot in task.slots:
            for address in filter(None, (slot.gpu_pci_address, slot.fabric_vf_pci_address)):
                if not fs.exists(f"/sys/bus/pci/devices/{address}"):
                    raise Refused("device_missing", f"PCI device {address} of slot {slot.slot_id} is not on this host")
        try:
            _, memory_mib, hugepages = vm_resources(task.slots[0].profile, len(task.slots))
        except ValueError as exc:
            raise Refused("unknown_profile", str(exc)) from exc
        if hugepages:
            need = -(-memory_mib // 1024)
            free = fs.read(HUGEPAGES_1G_FREE)
            if free is None or not free.isdigit() or int(free) < need:
                raise Refused(
                    "hugepages_insufficient", f"profile needs {need} free 1 GiB hugepages, host has {free or 0}"
                )

    async def _validate_xml(self, xml: str) -> None:
        if self.host.run.which("virt-xml-validate") is None:
            return
        path = self.seed_dir / f".validate-{uuid.uuid4().hex}.xml"
        path.write_text(xml)
        try:
            res = await self.host.run.run("virt-xml-validate", str(path), "domain")
        finally:
            path.unlink(missing_ok=True)
        if not res.ok:
            raise Refused("domain_xml_invalid", (res.stderr or res.stdout)[:1000])

    async def _provision(self, task: m.SliceVmProvision) -> m.NodeTaskResult:
        t = "slice.vm_provision"
        await self._phase(task, t, "preflight")
        await self._preflight_host(task)
        disks = [self._check_disk(s.nvme_by_id) for s in task.slots]
        image_path = await self._verify_image(task.image)
        resources = [f"gpu:{s.gpu_pci_address}" for s in task.slots] + [f"nvme:{s.nvme_by_id}" for s in task.slots]
        resources += [f"vf:{s.fabric_vf_pci_address}" for s in task.slots if s.fabric_vf_pci_address]
        conflict = self.store.take_leases(resources, str(task.allocation_id))
        if conflict:
            raise Refused("resource_leased", conflict)
        if await self.libvirt.exists(task.vm_name):
            raise Refused("domain_exists", f"a domain named {task.vm_name} is already defined")
        primary = task.slots[0]
        try:
            vcpus, memory_mib, hugepages = vm_resources(primary.profile, len(task.slots))
            spec = SliceVmSpec(
                vm_name=task.vm_name,
                uuid=str(uuid.uuid5(uuid.NAMESPACE_URL, str(task.allocation_id))),
                vcpus=vcpus,
                memory_mib=memory_mib,
                hugepages=hugepages,
                numa_node=primary.numa_node,
                gpus=[s.gpu_pci_address for s in task.slots],
                fabric_vfs=[s.fabric_vf_pci_address for s in task.slots if s.fabric_vf_pci_address],
                nvme_by_id=[str(d) for d in disks],
                seed_iso_path=str(self.seed_dir / f"{task.vm_name}.iso"),
                mac=primary.mac,
                bridge=primary.ovs_bridge,
            )
        except ValueError as exc:
            raise Refused("invalid_vm_spec", str(exc)[:1000]) from exc
        xml = render_domain_xml(spec)
        await self._validate_xml(xml)
        try:
            # The seed is rendered before the disk is touched: bad input must fail with nothing to clean.
            await self._phase(task, t, "seed")
            seed_path = self.seed_dir / f"{task.vm_name}.iso"
            keys = list(task.ssh_public_keys) + ([self.relay_public_key] if self.relay_public_key else [])
            try:
                await seed_iso.write_seed_iso(
                    seed_path, instance_id=str(task.allocation_id), hostname=task.hostname, ssh_authorized_keys=keys
                )
            except seed_iso.SeedIsoError as exc:
                raise Refused("invalid_seed", str(exc)) from exc
            await self._phase(task, t, "clone_image", disk_touched=True)
            await disk.clone_image(str(image_path), "raw", str(disks[0]))
            await self._phase(task, t, "define")
            await self.libvirt.define_and_start(xml)
            await self._phase(task, t, "dhcp_reservation")
            dnsmasq.write_reservation(self.hostsdir, task.vm_name, primary.mac, primary.private_ip, task.hostname)
            await self._phase(task, t, "wait_ready")
            ready = await readiness.wait_ready(
                self.lease_file, primary.mac, primary.private_ip, self.ssh_port, self.readiness_timeout_s
            )
        except Refused:
            raise
        except Exception as exc:
            raise TaskFailed("provision_error", f"{type(exc).__name__}: {exc}") from exc
        if not (ready.ssh_ready and ready.lease_state == "bound"):
            raise TaskFailed("not_ready", f"lease {ready.lease_state}, ssh_ready={ready.ssh_ready}")
        readiness_ev = m.Readiness(
            mac=ready.mac,
            expected_ip=ready.expected_ip,
            actual_ip=ready.actual_ip,
            lease_state=ready.lease_state,
            ssh_ready=ready.ssh_ready,
        )
        await self._phase(task, t, "ready")
        return self._result(task, t, "succeeded", readiness_=readiness_ev)

    # --- release ---------------------------------------------------------------------------------

    async def _release(self, task: m.SliceVmRelease) -> m.NodeTaskResult:
        t = "slice.vm_release"
        await self._phase(task, t, "stop")
        try:
            if await self.libvirt.exists(task.vm_name):
                stopped = await self.libvirt.shutdown(task.vm_name, self.shutdown_timeout_s)
                await self._phase(task, t, "undefine", detail=f"stop path: {stopped.value}")
                await self.libvirt.undefine(task.vm_name)
            dnsmasq.remove_reservation(self.hostsdir, task.vm_name)
            seed = self.seed_dir / f"{task.vm_name}.iso"
            seed.unlink(missing_ok=True)
            # Every disk is re-checked before the first one is wiped: host state may have changed since provision.
            paths = [(slot.nvme_by_id, self._check_disk(slot.nvme_by_id)) for slot in task.slots]
            await self._phase(task, t, "wipe", disk_touched=True)
            proofs = []
            for by_id, path in paths:
                proof = await disk.wipe_and_verify(str(path))
                proofs.append(
                    m.WipeProof(
                        device=by_id,
                        method=proof.method,
                        verified=proof.verified,
                        signatures=[str(sig) for sig in proof.signatures],
                        detail=proof.detail,
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
                task, t, "failed", code="wipe_unverified", reason=reason[:2000], cleanup_required=True, proofs=proofs
            )
        self.store.drop_leases(str(task.allocation_id))
        await self._phase(task, t, "released")
        return self._result(task, t, "succeeded", proofs=proofs)
