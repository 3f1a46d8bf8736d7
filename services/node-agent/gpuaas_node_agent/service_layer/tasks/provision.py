"""slice.vm_provision: preflight the host, verify the cached image (both in preflight.py) and the disks, take
the leases, then seed, clone, reserve DHCP, define and wait for the VM to be reachable: its lease, then a login
that matches the host key the seed planted, with cloud-init done, that reads what the guest sees of its GPUs;
the guest must see the GPUs its slot group passed through. Each phase's time goes on the result and into a
histogram."""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path
from typing import Any

from prometheus_client import Histogram

from gpuaas_common.contract import TaskType
from gpuaas_common.contract import messages as m

from ...adapters import disk, dnsmasq, guest_ssh, ovs, readiness, seed_iso
from ...adapters.discovery import HUGEPAGES_1G_FREE
from ...adapters.libvirt_host import DomainState, LibvirtHostError
from ...domain.domain_xml import render_domain_xml, tap_name
from ...domain.guest_gpus import ReportInvalid, judge, parse_report
from ...domain.profiles import vm_resources
from ...domain.vm_spec import SliceVmSpec
from . import phases, preflight
from .context import GuestLogin, HostContext, Refused, TaskFailed, log
from .disks import check_disk
from .nvlink import NvlinkPartitions

__all__ = ["HUGEPAGES_1G_FREE", "PHASE_SECONDS", "ProvisionTask", "slot_lease"]

PHASE_SECONDS = Histogram(
    "gpuaas_slice_provision_phase_seconds",
    "Seconds each phase of a slice provision took on its host",
    ["phase"],
    buckets=(0.1, 0.5, 1, 2, 5, 10, 20, 30, 60, 90, 120, 180, 300, 600),
)
# Phases after which a running domain is the one this task made: a resumed task waits for it, never makes a second.
_DOMAIN_MADE = ("define", "dhcp_reservation", "wait_ready", "boot", "lease", "ssh", "cloud_init")


def slot_lease(slot: m.SlotBinding) -> str:
    """The lease that says which allocation a slot's hardware belongs to: its GPU, or on a lab host (no GPU)
    its disk."""
    return f"gpu:{slot.gpu_pci_address}" if slot.gpu_pci_address else f"nvme:{slot.nvme_by_id}"


class _Clock:
    """Seconds per phase, in the order they ran."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._phase: str | None = None
        self._since = time.monotonic()

    def enter(self, phase: str | None) -> None:
        now = time.monotonic()
        if self._phase is not None:
            spent = round(now - self._since, 3)
            self.seconds[self._phase] = self.seconds.get(self._phase, 0.0) + spent
            PHASE_SECONDS.labels(self._phase).observe(spent)
        self._phase, self._since = phase, now


class ProvisionTask:
    """slice.vm_provision on this host: the VM's shape (domain and bridge kind), the guest's users and keys,
    and how its readiness is checked come with the constructor; the partitions of its NVLinks from `nvlink`."""

    def __init__(
        self,
        ctx: HostContext,
        nvlink: NvlinkPartitions,
        *,
        ssh_port: int,
        readiness_timeout_s: float,
        relay_public_key: str | None = None,
        domain_type: str = "kvm",
        bridge_kind: str = "openvswitch",
        guest_user: str = "gpuaas",
        console_user: str = "gpuaas-console",
        readiness_key: tuple[Path, str] | None = None,
        guest_login: GuestLogin | None = None,
    ) -> None:
        self.ctx = ctx
        self.nvlink = nvlink
        self.ssh_port = ssh_port
        self.readiness_timeout_s = readiness_timeout_s
        self.relay_public_key = relay_public_key
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

    async def run(self, task: m.SliceVmProvision, left_running: dict[str, Any] | None) -> m.NodeTaskResult:
        """`left_running`: the task's record when a killed agent left it running; its domain is resumed if it
        still runs, else torn down and made again."""
        domain_kept = left_running is not None and await self.can_resume_domain(task, left_running)
        if left_running is not None:
            log.warning(
                "task_resuming",
                task_id=task.task_id,
                allocation_id=str(task.allocation_id),
                domain_kept=domain_kept,
            )
            if not domain_kept:
                await self.tear_down(task)
        return await self._provision(task, resume=domain_kept)

    async def tear_down(self, task: Any) -> None:
        """Never leave a half-provisioned VM defined or running: it would hold the GPUs and the disk."""
        ctx = self.ctx
        try:
            if await ctx.libvirt.exists(task.vm_name):
                await ctx.libvirt.shutdown(task.vm_name, 0)
                await ctx.libvirt.undefine(task.vm_name)
                log.warning(
                    "libvirt_domain_torn_down",
                    task_id=task.task_id,
                    allocation_id=str(task.allocation_id),
                    domain=task.vm_name,
                )
            dnsmasq.remove_reservation(ctx.hostsdir, task.vm_name)
            await self.nvlink.deactivate_quietly(task)
        except (LibvirtHostError, OSError) as exc:
            log.error("libvirt_domain_teardown_failed", task_id=task.task_id, domain=task.vm_name, error=str(exc))

    async def can_resume_domain(self, task: m.SliceVmProvision, record: dict[str, Any] | None) -> bool:
        """A provision interrupted after it defined its domain resumes that domain when it still runs: the agent
        restarted, the guest did not. Anything else is torn down and made again."""
        if not record or record.get("phase") not in _DOMAIN_MADE:
            return False
        state = await self.ctx.libvirt.state(task.vm_name)
        return state in (DomainState.RUNNING, DomainState.BLOCKED) and self._host_key_path(task).exists()

    def _host_key_path(self, task: m.SliceVmProvision) -> Path:
        return self.ctx.seed_dir / f"{task.vm_name}.hostkey"

    async def _host_key(self, task: m.SliceVmProvision) -> guest_ssh.HostKey:
        """The guest's host key, made once per VM and kept (its private half, 0600, beside the seed) so that a
        resumed task checks the key the running guest got; removed with the seed at release."""
        path = self._host_key_path(task)

        def _load_or_make() -> guest_ssh.HostKey:
            if path.exists():
                return guest_ssh.HostKey.from_private(path.read_text())
            key = guest_ssh.new_host_key()
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            tmp.unlink(missing_ok=True)
            tmp.touch(mode=0o600)
            tmp.write_text(key.private_openssh)
            tmp.replace(path)
            return key

        return await asyncio.to_thread(_load_or_make)

    def _check_reachable(self, primary: m.SlotBinding, ready: readiness.Readiness) -> None:
        if ready.host_key_mismatch:
            raise TaskFailed(
                "host_key_mismatch", ready.detail or "the guest's host key is not the one its seed planted"
            )
        if ready.lease_state != "bound":
            raise TaskFailed(
                "lease_timeout",
                f"no DHCP lease of {primary.private_ip} for {primary.mac} within {self.readiness_timeout_s:.0f}s "
                f"(lease {ready.lease_state})",
            )
        if ready.gpu_report_missing:
            raise TaskFailed(
                "guest_report_missing",
                f"the guest did not report its GPUs within {self.readiness_timeout_s:.0f}s: {ready.detail}",
            )
        if not ready.ssh_ready:
            raise TaskFailed("not_ready", f"lease bound, ssh not ready: {ready.detail or 'no answer'}")

    def _check_guest_gpus(self, task: m.SliceVmProvision, ready: readiness.Readiness) -> m.GuestGpus:
        """The guest must see every GPU its slot group passed through (the lab's slots pass none: its guests must
        see none), with a working driver where the image has it preinstalled. Only an agent told its guests are
        no machines (readiness_login off, without the simulator's login) has nobody to ask."""
        if ready.gpu_report is None:
            raise TaskFailed("guest_report_missing", "the guest's login returned no GPU report")
        try:
            report = parse_report(ready.gpu_report)
        except ReportInvalid as exc:
            raise TaskFailed("guest_report_invalid", str(exc)) from exc
        verdict = judge(report, sum(1 for s in task.slots if s.gpu_pci_address), task.image.driver_strategy)
        log.info(
            "guest_gpus_checked",
            task_id=task.task_id,
            allocation_id=str(task.allocation_id),
            verdict=verdict.code or "ok",
            **verdict.evidence.model_dump(),
        )
        if verdict.code:
            raise TaskFailed(verdict.code, verdict.reason or verdict.code)
        return verdict.evidence

    async def _provision(self, task: m.SliceVmProvision, *, resume: bool = False) -> m.NodeTaskResult:
        t = TaskType.SLICE_VM_PROVISION
        clock = _Clock()

        async def phase(name: str, **kw: Any) -> None:
            clock.enter(name)
            await phases.enter(self.ctx, task, t, name, **kw)

        await phase("preflight")
        await preflight.check_host(self.ctx.host, self.domain_type, task)
        disks = [check_disk(self.ctx.host, s.nvme_by_id) for s in task.slots]
        image_path = await preflight.verify_image(self.ctx.paths, self.ctx.store, task.image)
        resources = [f"gpu:{s.gpu_pci_address}" for s in task.slots if s.gpu_pci_address]
        resources += [f"nvme:{s.nvme_by_id}" for s in task.slots]
        resources += [f"vf:{s.fabric_vf_pci_address}" for s in task.slots if s.fabric_vf_pci_address]
        conflict = self.ctx.store.take_leases(resources, str(task.allocation_id))
        if conflict:
            raise Refused("resource_leased", conflict)
        # `resume`: the runner found this task's own domain still running from before a restart.
        resumed = resume and await self.ctx.libvirt.state(task.vm_name) in (DomainState.RUNNING, DomainState.BLOCKED)
        if not resumed and await self.ctx.libvirt.exists(task.vm_name):
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
                gpus=[s.gpu_pci_address for s in task.slots if s.gpu_pci_address],
                fabric_vfs=[s.fabric_vf_pci_address for s in task.slots if s.fabric_vf_pci_address],
                nvme_by_id=[str(d) for d in disks],
                seed_iso_path=str(self.ctx.seed_dir / f"{task.vm_name}.iso"),
                mac=primary.mac,
                bridge=primary.ovs_bridge,
                bridge_kind=self.bridge_kind,
                domain_type=self.domain_type,
                console_log_path=str(self.ctx.seed_dir / f"{task.vm_name}.console.log"),
            )
        except ValueError as exc:
            raise Refused("invalid_vm_spec", str(exc)[:1000]) from exc
        xml = render_domain_xml(spec)
        await preflight.validate_xml(self.ctx.host, self.ctx.seed_dir, xml)
        # After every other refusal and before the disk is touched: FM_ST_IN_USE refuses with nothing written.
        await self.nvlink.activate(task)
        login_key = self.readiness_key
        try:
            host_key = await self._host_key(task) if login_key else None
            if resumed:
                await phase("wait_ready", detail="resumed: the domain this task defined is still running")
            else:
                # The seed is rendered before the disk is touched: bad input must fail with nothing to clean.
                await phase("seed")
                seed_path = self.ctx.seed_dir / f"{task.vm_name}.iso"
                # The relay key goes to the console user alone (seed_iso): never beside the tenant's sudo login.
                keys = list(task.ssh_public_keys) + ([login_key[1]] if login_key else [])
                try:
                    await seed_iso.write_seed_iso(
                        seed_path,
                        instance_id=str(task.allocation_id),
                        hostname=task.hostname,
                        ssh_authorized_keys=keys,
                        username=self.guest_user if login_key else None,
                        relay_public_key=self.relay_public_key,
                        console_user=self.console_user,
                        host_key=(host_key.private_openssh, host_key.public_line) if host_key else None,
                    )
                except seed_iso.SeedIsoError as exc:
                    raise Refused("invalid_seed", str(exc)) from exc
                await phase("clone_image", disk_touched=True)
                await disk.clone_image(str(image_path), "raw", str(disks[0]))
                # Reserved before the guest exists, so its first DHCP request already finds its address.
                await phase("dhcp_reservation")
                dnsmasq.write_reservation(
                    self.ctx.hostsdir, task.vm_name, primary.mac, primary.private_ip, task.hostname
                )
                await phase("define")
                await self.ctx.libvirt.define_and_start(xml)
                if self.bridge_kind == "openvswitch":
                    # Before the guest can send its first frame past DHCP: slices never reach each other.
                    await phase("isolate")
                    try:
                        await ovs.protect_port(self.ctx.host, tap_name(task.vm_name))
                    except ovs.OvsError as exc:
                        raise TaskFailed("isolation_failed", str(exc)) from exc
                await phase("wait_ready")
            login = self.guest_login
            if login_key and host_key:
                login = lambda ip: guest_ssh.login(  # noqa: E731
                    ip, self.ssh_port, self.guest_user, login_key[0], host_key.public_line
                )
            ready = await readiness.wait_ready(
                self.ctx.lease_file,
                primary.mac,
                primary.private_ip,
                self.ssh_port,
                self.readiness_timeout_s,
                login=login,
            )
        except (Refused, TaskFailed):
            raise
        except Exception as exc:
            raise TaskFailed("provision_error", f"{type(exc).__name__}: {exc}") from exc
        clock.enter(None)
        self._check_reachable(primary, ready)
        guest_gpus = self._check_guest_gpus(task, ready) if login is not None else None
        seconds = {**clock.seconds, **ready.phase_seconds}
        for name, spent in ready.phase_seconds.items():
            PHASE_SECONDS.labels(name).observe(spent)
        readiness_ev = m.Readiness(
            mac=ready.mac,
            expected_ip=ready.expected_ip,
            actual_ip=ready.actual_ip,
            lease_state=ready.lease_state,
            ssh_ready=ready.ssh_ready,
            ssh_user=self.guest_user if login_key else None,
            ssh_port=self.ssh_port,
            host_key_fingerprint=host_key.fingerprint if host_key else None,
            phase_seconds=seconds,
            guest_gpus=guest_gpus,
        )
        await phases.enter(self.ctx, task, t, "ready", detail=" ".join(f"{k}={v:.1f}s" for k, v in seconds.items()))
        return phases.result(self.ctx, task, t, "succeeded", readiness_=readiness_ev)
