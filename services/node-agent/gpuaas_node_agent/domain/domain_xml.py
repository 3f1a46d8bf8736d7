"""libvirt domain XML for a slice VM. Pure: values go in through ElementTree, never by string templating."""

from __future__ import annotations

import hashlib
import xml.etree.ElementTree as ET

from .vm_spec import SliceVmSpec, parse_cpuset, parse_pci_address


def _sub(parent: ET.Element, tag: str, text: str | None = None, **attrs: str) -> ET.Element:
    el = ET.SubElement(parent, tag, attrs)
    if text is not None:
        el.text = text
    return el


def _hostdev(devices: ET.Element, address: str) -> None:
    pci = parse_pci_address(address)
    # managed='no': the device stays on vfio-pci (persistent driverctl override) for as long as the host is in
    # slice mode; with 'yes' libvirt would rebind it to the host driver whenever the VM stops.
    hostdev = _sub(devices, "hostdev", mode="subsystem", type="pci", managed="no")
    _sub(hostdev, "driver", name="vfio")
    source = _sub(hostdev, "source")
    _sub(
        source,
        "address",
        domain=f"0x{pci.domain:04x}",
        bus=f"0x{pci.bus:02x}",
        slot=f"0x{pci.slot:02x}",
        function=f"0x{pci.function:x}",
    )


def _cputune(root: ET.Element, spec: SliceVmSpec) -> None:
    if spec.cpuset is None:
        return
    cpus = parse_cpuset(spec.cpuset)
    cputune = _sub(root, "cputune")
    for vcpu in range(spec.vcpus):
        # 1:1 pinning when the set is large enough, else float over the set (still NUMA-local).
        target = str(cpus[vcpu]) if len(cpus) >= spec.vcpus else spec.cpuset
        _sub(cputune, "vcpupin", vcpu=str(vcpu), cpuset=target)
    _sub(cputune, "emulatorpin", cpuset=spec.cpuset)


def render_domain_xml(spec: SliceVmSpec) -> str:
    root = ET.Element("domain", type=spec.domain_type)
    _sub(root, "name", spec.vm_name)
    _sub(root, "uuid", spec.uuid)
    _sub(root, "memory", str(spec.memory_mib), unit="MiB")
    _sub(root, "currentMemory", str(spec.memory_mib), unit="MiB")

    if spec.hugepages:
        backing = _sub(root, "memoryBacking")
        hugepages = _sub(backing, "hugepages")
        _sub(hugepages, "page", size="1", unit="GiB")
        # VFIO pins all guest memory for DMA anyway; locked makes that explicit and keeps it off swap.
        _sub(backing, "locked")

    vcpu_attrs = {"placement": "static"}
    if spec.cpuset is not None:
        vcpu_attrs["cpuset"] = spec.cpuset
    _sub(root, "vcpu", str(spec.vcpus), **vcpu_attrs)
    _cputune(root, spec)
    if spec.numa_node is not None:
        numatune = _sub(root, "numatune")
        _sub(numatune, "memory", mode="strict", nodeset=str(spec.numa_node))

    os_el = _sub(root, "os")
    _sub(os_el, "type", "hvm", arch="x86_64", machine="q35")
    _sub(os_el, "loader", spec.loader_path, readonly="yes", secure="no", type="pflash")
    _sub(os_el, "nvram", spec.nvram_path, template=spec.nvram_template_path)

    features = _sub(root, "features")
    _sub(features, "acpi")
    _sub(features, "apic")
    if spec.domain_type == "kvm":
        _sub(root, "cpu", mode="host-passthrough", check="none", migratable="off")
    else:
        # TCG cannot pass the host CPU through; `maximum` is every feature QEMU can emulate.
        _sub(root, "cpu", mode="maximum", check="none", migratable="off")
    _sub(root, "clock", offset="utc")
    _sub(root, "on_poweroff", "destroy")
    _sub(root, "on_reboot", "restart")
    _sub(root, "on_crash", "destroy")

    devices = _sub(root, "devices")
    for index, path in enumerate(spec.nvme_by_id):
        kind = spec.disk_type(path)
        disk = _sub(devices, "disk", type=kind, device="disk")
        # Raw device, host page cache bypassed; discard passes guest TRIM through to the NVMe.
        _sub(disk, "driver", name="qemu", type="raw", cache="none", io="native", discard="unmap")
        if kind == "block":
            _sub(disk, "source", dev=path)
        else:
            _sub(disk, "source", file=path)
        _sub(disk, "target", dev=f"vd{chr(ord('a') + index)}", bus="virtio")
        if index == 0:
            _sub(disk, "boot", order="1")

    # The seed CD sits on virtio-scsi, not SATA: cloud kernels (Debian's cloud flavour among them) carry
    # virtio_scsi and sr_mod but no AHCI driver, and a guest that cannot see its seed never gets its keys.
    _sub(devices, "controller", type="scsi", index="0", model="virtio-scsi")
    seed = _sub(devices, "disk", type="file", device="cdrom")
    _sub(seed, "driver", name="qemu", type="raw")
    _sub(seed, "source", file=spec.seed_iso_path)
    _sub(seed, "target", dev="sda", bus="scsi")
    _sub(seed, "readonly")

    # Slices never reach each other on the slice network (checklist: tenant isolation), only the host's side of
    # the bridge (gateway, DHCP, metadata). A Linux bridge does it per port (`isolated`, applied by libvirt); an
    # OVS port is marked `protected` by the agent once the tap exists, under the name given here.
    nic = _sub(devices, "interface", type="bridge")
    _sub(nic, "mac", address=spec.mac)
    _sub(nic, "source", bridge=spec.bridge)
    if spec.bridge_kind == "openvswitch":
        _sub(nic, "virtualport", type="openvswitch")
        _sub(nic, "target", dev=tap_name(spec.vm_name))
    else:
        _sub(nic, "port", isolated="yes")
    _sub(nic, "model", type="virtio")

    for address in [*spec.gpus, *spec.fabric_vfs]:
        _hostdev(devices, address)

    serial = _sub(devices, "serial", type="pty")
    if spec.console_log_path:
        # The console stays interactive (pty) and is also kept: a guest that never comes up says why there.
        _sub(serial, "log", file=spec.console_log_path, append="off")
    _sub(serial, "target", port="0")
    console = _sub(devices, "console", type="pty")
    _sub(console, "target", type="serial", port="0")
    # Ballooning cannot reclaim pinned VFIO memory; the device would only mislead the guest.
    _sub(devices, "memballoon", model="none")

    ET.indent(root, space="  ")
    return ET.tostring(root, encoding="unicode")


def tap_name(vm_name: str) -> str:
    """The slice NIC's tap (and OVS port) name: stable per VM, within the kernel's 15 characters, and outside
    libvirt's own `vnet` prefix, so the agent can find the port again after a restart."""
    return "gs" + hashlib.sha256(vm_name.encode()).hexdigest()[:12]
