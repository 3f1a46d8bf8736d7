"""A provision's checks before anything is written: the host can run the VM (KVM, IOMMU and VFIO where devices
pass through, the bridges, the devices on vfio-pci and no host GPU service holding them, enough free 1 GiB
hugepages), the cached image has the digest the task names, and libvirt accepts the domain XML. Each one that
fails is a Refused."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

from gpuaas_common.contract import messages as m
from gpuaas_common.digests import sha256_file

from ...adapters import driverctl
from ...adapters.discovery import hugepages_1g
from ...adapters.host import Host
from ...adapters.parity import ParityChecker
from ...adapters.state_store import StateStore
from ...domain.device_binding import wrong_bindings
from ...domain.profiles import hugepages_1g_needed
from ..host_paths import HostPaths
from .context import Refused


async def verify_image(paths: HostPaths, store: StateStore, image: m.ImageRef) -> Path:
    path = paths.host(image.image_path)
    try:
        st = path.stat()
    except FileNotFoundError:
        raise Refused(
            "image_not_cached", f"image {image.slug} is not in the node cache at {image.image_path}"
        ) from None
    cached = store.verified_digest(str(path), st.st_size, st.st_mtime)
    digest = cached or await asyncio.to_thread(sha256_file, path)
    if digest != image.digest_sha256:
        raise Refused("image_unverified", f"cached {image.slug} has digest {digest}, expected {image.digest_sha256}")
    if not cached:
        store.remember_digest(str(path), digest, st.st_size, st.st_mtime)
    return path


async def check_host(host: Host, domain_type: str, task: m.SliceVmProvision) -> None:
    fs = host.fs
    parity = ParityChecker(host)
    passthrough = any(s.gpu_pci_address or s.fabric_vf_pci_address for s in task.slots)
    if passthrough and domain_type != "kvm":
        raise Refused("passthrough_needs_kvm", f"slots pass PCI devices through; domain type is {domain_type}")
    checks = [parity.kvm] if domain_type == "kvm" else []
    # IOMMU and VFIO matter only to devices passed through; a lab slot has none and says so.
    checks += [parity.iommu_groups, parity.vfio_modules] if passthrough else []
    for check in checks:
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
        address: driverctl.bound_driver(host, address)
        for slot in task.slots
        for address in filter(None, (slot.gpu_pci_address, slot.fabric_vf_pci_address))
    }
    wrong = wrong_bindings(bound)
    if wrong:
        raise Refused("device_not_vfio", "; ".join(wrong))
    for check in (parity.nvidia_persistenced, parity.nvidia_fabricmanager) if passthrough else ():
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
            raise Refused("hugepages_insufficient", f"profile needs {need} free 1 GiB hugepages, host has {free or 0}")


async def validate_xml(host: Host, seed_dir: Path, xml: str) -> None:
    if host.run.which("virt-xml-validate") is None:
        return
    path = seed_dir / f".validate-{uuid.uuid4().hex}.xml"
    path.write_text(xml)
    try:
        res = await host.run.run("virt-xml-validate", str(path), "domain")
    finally:
        path.unlink(missing_ok=True)
    if not res.ok:
        raise Refused("domain_xml_invalid", (res.stderr or res.stdout)[:1000])
