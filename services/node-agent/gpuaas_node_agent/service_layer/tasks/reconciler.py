"""The agent's reconciler: the host as it is (libvirt domains, DHCP reservation files, resource leases) against
the agent's task records. Orphans are swept where the record proves they are ours and dead (a reservation file
of a VM that is released, failed or never provisioned); everything else that disagrees is drift, returned and
logged as evidence for ops, never "fixed" by guesswork.

Device binding (driverctl overrides against the approved topology) belongs here too once the binding work lands:
`_binding_drift` is its hook."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ...adapters import dnsmasq
from .core import log
from .runner import TaskRunner


@dataclass(frozen=True)
class Drift:
    kind: str  # domain_unmanaged, domain_missing, dhcp_reservation_orphaned, lease_orphaned, device_binding
    subject: str
    detail: str
    swept: bool = False


def _live(record: tuple[str, str] | None) -> bool:
    """A VM the records say should exist (or may, while its task runs)."""
    if record is None:
        return False
    task_type, status = record
    return (task_type == "slice.vm_provision" and status in ("running", "succeeded")) or (
        task_type == "slice.vm_release" and status in ("running", "failed", "refused")
    )


class HostReconciler(TaskRunner):
    async def reconcile_host(self) -> list[Drift]:
        """One pass: stale domains removed (see reconcile_domains), orphaned reservation files swept, the rest
        reported. Safe to run at start and periodically: it never touches a VM whose task is running."""
        await self.reconcile_domains()
        latest = self.store.latest_by_vm()
        drift: list[Drift] = []
        domains = {d.name for d in await self.libvirt.list_domains()}
        for name in sorted(domains - set(latest)):
            drift.append(Drift("domain_unmanaged", name, "libvirt domain the agent has no task record of"))
        for vm, record in sorted(latest.items()):
            if record == ("slice.vm_provision", "succeeded") and vm not in domains:
                drift.append(Drift("domain_missing", vm, "provisioned VM whose libvirt domain is gone"))
        for name in sorted(dnsmasq.read_reservations(self.hostsdir)):
            record = latest.get(name)
            if _live(record):
                continue
            if record is None:
                # Not a VM of ours by name: report, leave it (ops may have written it by hand).
                drift.append(Drift("dhcp_reservation_orphaned", name, "reservation file of no VM the agent knows"))
                continue
            dnsmasq.remove_reservation(self.hostsdir, name)
            drift.append(
                Drift("dhcp_reservation_orphaned", name, f"reservation of a VM whose last task is {record}", True)
            )
        live_allocations = self.store.live_allocations()
        for resource, allocation_id in sorted(self.store.leased_resources().items()):
            if allocation_id not in live_allocations:
                # Kept on purpose after an unverified wipe; ops decide, so it is reported, not dropped.
                drift.append(Drift("lease_orphaned", resource, f"leased to allocation {allocation_id} with no live VM"))
        drift += await self._binding_drift()
        for d in drift:
            log.warning("node_drift_detected", node_id=self.node_id, **asdict(d))
        return drift

    async def _binding_drift(self) -> list[Drift]:
        """Hook for the device-binding check (approved GPU/fabric devices bound to vfio-pci)."""
        return []
