"""The agent's reconciler: the host as it is (libvirt domains, device binding, slot disks, DHCP reservation
files, resource leases) against the agent's task records. Orphans are swept where the record proves they are
ours and dead (a reservation file of a VM that is released, failed or never provisioned); everything else that
disagrees is drift, returned and reported as evidence (`node.drift_reported`, the full current list each time)
so the scheduler stops placing on what drifted until the host agrees again or ops acknowledge it. Nothing is
"fixed" by guesswork.

It runs at start (after recovery) and then every `reconcile_interval_s`, while tasks run: it never acts on a
VM whose task holds the VM's lock, and it reads nothing of a slot whose task holds the slot's lock."""

from __future__ import annotations

import asyncio
from dataclasses import asdict
from typing import Any

from gpuaas_common.bus_dispatch import HeldDeadLetters
from gpuaas_common.cancellation import stop_if_cancelled
from gpuaas_common.contract import TaskType, utcnow
from gpuaas_common.contract import messages as m

from ...adapters import disk, dnsmasq, driverctl
from ...domain.device_binding import binding_problems
from .context import HostContext, Refused, TaskLocks, log
from .disks import check_disk
from .drift import Drift, live, slots_using
from .nvlink import NvlinkPartitions


class HostReconciler:
    """`held_dead_letters`: the host bus's dead letters, kept at home; their count goes out with each drift
    report (none where no bus holds them)."""

    def __init__(
        self,
        ctx: HostContext,
        locks: TaskLocks,
        nvlink: NvlinkPartitions,
        *,
        held_dead_letters: HeldDeadLetters | None = None,
    ) -> None:
        self.ctx = ctx
        self.locks = locks
        self.nvlink = nvlink
        self.held_dead_letters = held_dead_letters

    async def reconcile_host(self) -> list[Drift]:
        """One pass: stale domains removed (see reconcile_domains), orphaned reservation files swept, the rest
        reported. Safe to run at start and periodically: it never touches a VM whose task is running."""
        await self.reconcile_domains()
        latest = self.ctx.store.latest_by_vm()
        slots = self.ctx.store.slot_records()
        vm_slots: dict[str, list[str]] = {}
        for slot_id, rec in sorted(slots.items()):
            if rec["vm_name"]:
                vm_slots.setdefault(rec["vm_name"], []).append(slot_id)
        drift: list[Drift] = []
        domains = {d.name for d in await self.ctx.libvirt.list_domains()}
        for name in sorted(domains - set(latest)):
            # Nobody knows what it holds: the whole node until ops look.
            drift.append(Drift("domain_unmanaged", name, "libvirt domain the agent has no task record of"))
        for vm, record in sorted(latest.items()):
            if (
                record == (TaskType.SLICE_VM_PROVISION, "succeeded")
                and vm not in domains
                and not self.locks.vm_busy(vm)
            ):
                drift.append(
                    Drift(
                        "domain_missing",
                        vm,
                        "provisioned VM whose libvirt domain is gone",
                        slot_ids=tuple(vm_slots.get(vm, ())),
                    )
                )
        drift += self._sweep_reservations()
        # Leases first, live allocations second: a lease taken after the first read belongs to a task that
        # started before the second, so a running provision is never reported as an orphan.
        leased = self.ctx.store.leased_resources()
        live_allocations = self.ctx.store.live_allocations()
        for resource, allocation_id in sorted(leased.items()):
            if allocation_id not in live_allocations:
                device = resource.split(":", 1)[1] if ":" in resource else resource
                # Kept on purpose after an unverified wipe; ops decide, so it is reported, not dropped.
                drift.append(
                    Drift(
                        "lease_orphaned",
                        resource,
                        f"leased to allocation {allocation_id} with no live VM",
                        slot_ids=slots_using(slots, device),
                        devices=(device,),
                    )
                )
        drift += await self._binding_drift(slots)
        drift += await self._disk_drift(slots)
        live_vms = {vm for vm, record in latest.items() if live(record) or self.locks.vm_busy(vm)}
        drift += [Drift("nvlink_partition", subject, detail) for subject, detail in await self.nvlink.drift(live_vms)]
        for d in drift:
            log.warning("node_drift_detected", node_id=self.ctx.node_id, **asdict(d))
        return drift

    async def reconcile_domains(self) -> None:
        """A domain whose last task was a failed provision or a finished release must not exist: stop and
        undefine it. Domains the agent has no record of are reported and left alone (not ours to touch), and
        so is a domain whose task is running."""
        latest = self.ctx.store.latest_by_vm()
        for dom in await self.ctx.libvirt.list_domains():
            record = latest.get(dom.name)
            if record is None:
                log.info("libvirt_domain_unmanaged", domain=dom.name, state=dom.state.value)
                continue
            lock = self.locks.vm(dom.name)
            if lock.locked():
                continue  # its task is running: the task decides what becomes of the domain
            async with lock:
                # Under the VM's lock: a task for it waits until the domain is gone, never sees it half torn.
                task_type, status = self.ctx.store.latest_by_vm().get(dom.name, record)
                stale = (task_type == TaskType.SLICE_VM_PROVISION and status in ("failed", "refused")) or (
                    task_type == TaskType.SLICE_VM_RELEASE and status == "succeeded"
                )
                if stale:
                    await self.ctx.libvirt.shutdown(dom.name, 0)
                    await self.ctx.libvirt.undefine(dom.name)
                    log.warning("libvirt_domain_reconciled", domain=dom.name, last_task=task_type, last_status=status)

    def _sweep_reservations(self) -> list[Drift]:
        # Synchronous from the record read to the removal: no task can start on the VM in between.
        drift: list[Drift] = []
        latest = self.ctx.store.latest_by_vm()
        for name, reservation in sorted(dnsmasq.read_reservations(self.ctx.hostsdir).items()):
            record = latest.get(name)
            if live(record) or self.locks.vm_busy(name):
                continue
            if record is None:
                # Not a VM of ours by name: report, leave it (ops may have written it by hand).
                drift.append(
                    Drift(
                        "dhcp_reservation_orphaned",
                        name,
                        f"reservation file of no VM the agent knows ({reservation.mac} -> {reservation.ip})",
                        devices=(reservation.mac, reservation.ip),
                    )
                )
                continue
            dnsmasq.remove_reservation(self.ctx.hostsdir, name)
            drift.append(
                Drift("dhcp_reservation_orphaned", name, f"reservation of a VM whose last task is {record}", True)
            )
        return drift

    async def _binding_drift(self, slots: dict[str, dict[str, Any]]) -> list[Drift]:
        """Every approved device (a vfio-pci override, or a GPU or fabric VF of a slot the agent was handed)
        must keep its persistent override and be bound to vfio-pci now: domains use managed='no', so nothing
        rebinds a device for a VM, and a reboot without the override gives it back to the host driver."""
        wanted: dict[str, list[str]] = {}
        for slot_id, rec in sorted(slots.items()):
            b = rec["binding"]
            for dev in filter(None, (b.get("gpu_pci_address"), b.get("fabric_vf_pci_address"))):
                wanted.setdefault(dev, []).append(slot_id)
        if not wanted and self.ctx.host.run.which("driverctl") is None:
            # Nothing passed through (an emulated-slot host, or one with no slot handed to it yet) and no tool
            # that could have written an override: there is no binding to drift.
            return []
        try:
            overrides = await driverctl.list_overrides(self.ctx.host)
        except driverctl.DriverctlError as exc:
            return [Drift("device_binding", "driverctl", f"persistent overrides cannot be read: {exc}")]
        devices = set(wanted) | set(overrides)
        present = [d for d in devices if self.ctx.host.fs.exists(f"/sys/bus/pci/devices/{d}")]
        bound = {d: driverctl.bound_driver(self.ctx.host, d) for d in present}
        return [
            Drift("device_binding", dev, "; ".join(problems), slot_ids=tuple(wanted.get(dev, ())), devices=(dev,))
            for dev, problems in binding_problems(wanted, overrides, bound, present).items()
        ]

    async def _disk_drift(self, slots: dict[str, dict[str, Any]]) -> list[Drift]:
        """The disk of a slot with no live VM must be a whole, unheld disk with no signature left (the last
        release wiped it, or the failed provision never wrote it). Slots the agent never ran a task on are
        not its to judge: approval checked them."""
        drift: list[Drift] = []
        for slot_id, rec in sorted(slots.items()):
            by_id = rec["binding"].get("nvme_by_id")
            if not by_id or live((rec["task_type"], rec["status"])) or self.locks.slot_busy(slot_id):
                continue
            found = await self._probe_disk(by_id)
            # A task may have taken the slot while the probe ran: its disk is the task's now.
            if found is None or self.locks.slot_busy(slot_id):
                continue
            kind, detail = found
            drift.append(Drift(kind, by_id, detail, slot_ids=(slot_id,), devices=(by_id,)))
        return drift

    async def _probe_disk(self, by_id: str) -> tuple[str, str] | None:
        try:
            path = check_disk(self.ctx.host, by_id)
        except Refused as exc:
            return "disk_unusable", f"{exc.code}: {exc.reason}"
        try:
            found = await disk.signatures(path)
        except disk.DiskError as exc:
            return "disk_unusable", f"signature probe failed ({exc.code}): {exc}"
        if found:
            return "disk_dirty", "idle slot disk carries " + ", ".join(map(str, found))
        return None

    # --- reporting ------------------------------------------------------------------------------------

    async def report_drift(self) -> list[Drift]:
        """One pass, published as the full current list (an empty list says the host is clean again)."""
        drift = await self.reconcile_host()
        report = m.NodeDriftReported(
            node_id=self.ctx.node_id,
            checked_at=utcnow(),
            drift=[d.message() for d in drift],
            dead_lettered=self.held_dead_letters.count if self.held_dead_letters is not None else 0,
        )
        await self.ctx.publish("node.drift_reported", report, correlation_id=self.ctx.node_id, node_id=self.ctx.node_id)
        log.info("node_drift_reported", node_id=self.ctx.node_id, drift=len(drift), swept=sum(d.swept for d in drift))
        return drift

    async def reconcile_periodically(self, interval_s: float) -> None:
        """Report now, then every `interval_s`. A failed pass is logged and retried at the next tick: the
        reconciler must never take the agent down. Beside it, a Fabric Manager restart is watched for much more
        often: the active list is due within 60 seconds, whatever the reconcile interval."""
        watcher = asyncio.create_task(self.nvlink.watch_restarts())
        try:
            await self._reconcile_loop(interval_s)
        finally:
            watcher.cancel()

    async def _reconcile_loop(self, interval_s: float) -> None:
        while True:
            stop_if_cancelled()
            try:
                await self.report_drift()
            except Exception as exc:
                log.error("node_reconcile_failed", node_id=self.ctx.node_id, error=f"{type(exc).__name__}: {exc}")
            await asyncio.sleep(interval_s)
