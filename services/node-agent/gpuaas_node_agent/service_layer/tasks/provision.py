"""slice.vm_provision: preflight the host, verify the cached image and the disks, take the leases, then seed,
clone, define, reserve DHCP and wait for the VM to be reachable."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

from gpuaas_common.contract import messages as m
from gpuaas_common.digests import sha256_file

from ...adapters import disk, dnsmasq, driverctl, readiness, seed_iso
from ...adapters.discovery import HUGEPAGES_1G_FREE, hugepages_1g
from ...adapters.parity import ParityChecker
from ...domain.device_binding import wrong_bindings
from ...domain.domain_xml import render_domain_xml
from ...domain.profiles import hugepages_1g_needed, vm_resources
from ...domain.vm_spec import SliceVmSpec
from .core import AgentCore, Refused, TaskFailed

__all__ = ["HUGEPAGES_1G_FREE", "ProvisionTask"]


class ProvisionTask(AgentCore):
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
        # Domains use managed='no': libvirt will not rebind anything, so every device must already sit on
        # vfio-pci (driverctl overrides from slice mode) and no host GPU service may hold it.
        bound = {
            address: driverctl.bound_driver(self.host, address)
            for slot in task.slots
            for address in filter(None, (slot.gpu_pci_address, slot.fabric_vf_pci_address))
        }
        wrong = wrong_bindings(bound)
        if wrong:
            raise Refused("device_not_vfio", "; ".join(wrong))
        for check in (parity.nvidia_persistenced, parity.nvidia_fabricmanager):
            result = await check()
            if result.status != "PASS":
                raise Refused("host_gpu_services_active", f"{result.check}: {result.detail}")
        try:
            need = hugepages_1g_needed(task.slots[0].profile, len(task.slots))
        except ValueError as exc:
            raise Refused("unknown_profile", str(exc)) from exc
        if need:
            # The scheduler placed this on reported capacity; the pages free now are what counts.
            _, free = hugepages_1g(fs)
            if free is None or free < need:
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
