"""The slice VM's libvirt XML, pinned element by element, and accepted by a real libvirt driver."""

from __future__ import annotations

import uuid
import xml.etree.ElementTree as ET

import libvirt
import pytest
from pydantic import ValidationError

from gpuaas_node_agent.domain.domain_xml import render_domain_xml, tap_name
from gpuaas_node_agent.domain.vm_spec import PciAddress, PciAddressError, SliceVmSpec, parse_cpuset, parse_pci_address

DISK = "/dev/disk/by-id/nvme-eui.0025388b91c2a1f1"


def _spec(**overrides: object) -> SliceVmSpec:
    base: dict[str, object] = dict(
        vm_name=f"gpuaas-slice-{uuid.uuid4().hex[:12]}",
        uuid=str(uuid.uuid4()),
        vcpus=4,
        memory_mib=8192,
        hugepages=True,
        numa_node=1,
        cpuset="48-51",
        gpus=["0000:18:00.0", "0000:3B:00.0"],
        fabric_vfs=["0000:29:00.2"],
        nvme_by_id=[DISK],
        seed_iso_path="/var/lib/gpuaas/seeds/vm.iso",
        mac="52:54:00:AB:CD:01",
        bridge="ovsbr0",
    )
    base.update(overrides)
    return SliceVmSpec(**base)  # type: ignore[arg-type]


def _parse(spec: SliceVmSpec) -> ET.Element:
    return ET.fromstring(render_domain_xml(spec))


# --- PCI parser ---------------------------------------------------------------------------------------


def test_pci_address_round_trips_lowercase() -> None:
    assert parse_pci_address("0000:3B:00.1") == PciAddress(0, 0x3B, 0, 1)
    assert str(parse_pci_address(" 0000:3B:00.1 ")) == "0000:3b:00.1"


@pytest.mark.parametrize(
    ("text", "hint"),
    [
        ("18:00.0", "domain is missing"),
        ("0000:18:00.8", "function must be 0-7"),
        ("0000:18:20.0", "slot 0x20"),
        ("0000:18:00", "expected DDDD:BB:SS.F"),
        ("gpu0", "expected DDDD:BB:SS.F"),
        ("", "expected DDDD:BB:SS.F"),
    ],
)
def test_pci_address_errors_say_what_is_wrong(text: str, hint: str) -> None:
    with pytest.raises(PciAddressError, match=hint):
        parse_pci_address(text)


def test_spec_rejects_bad_pci_and_duplicates() -> None:
    with pytest.raises(ValidationError, match="invalid PCI address"):
        _spec(gpus=["18:00.0"])
    with pytest.raises(ValidationError, match="duplicate PCI address"):
        _spec(gpus=["0000:18:00.0", "0000:18:00.0"])


def test_spec_rejects_bad_mac_name_and_cpuset() -> None:
    with pytest.raises(ValidationError, match="multicast"):
        _spec(mac="01:00:5e:00:00:01")
    with pytest.raises(ValidationError, match="invalid vm_name"):
        _spec(vm_name="../etc")
    with pytest.raises(ValidationError, match="invalid cpuset"):
        _spec(cpuset="0-3,x")
    assert parse_cpuset("0-2,8,10-11") == [0, 1, 2, 8, 10, 11]


def test_sysfs_numa_minus_one_means_no_locality() -> None:
    assert _spec(numa_node=-1).numa_node is None
    with pytest.raises(ValidationError):
        _spec(numa_node=-2)


# --- the XML ------------------------------------------------------------------------------------------


def test_domain_basics() -> None:
    spec = _spec()
    root = _parse(spec)
    assert root.tag == "domain" and root.get("type") == "kvm"
    assert root.findtext("name") == spec.vm_name
    assert root.findtext("uuid") == spec.uuid
    assert root.find("memory").get("unit") == "MiB" and root.findtext("memory") == "8192"
    assert root.findtext("currentMemory") == "8192"
    assert root.findtext("vcpu") == "4"
    assert root.find("cpu").get("mode") == "host-passthrough"


def test_uefi_without_secure_boot_and_nvram_template() -> None:
    root = _parse(_spec(nvram_path="/var/lib/libvirt/qemu/nvram/vm_VARS.fd"))
    os_el = root.find("os")
    type_el = os_el.find("type")
    assert (type_el.text, type_el.get("arch"), type_el.get("machine")) == ("hvm", "x86_64", "q35")
    loader = os_el.find("loader")
    assert loader.get("type") == "pflash" and loader.get("readonly") == "yes"
    assert loader.get("secure") == "no"
    assert loader.text == "/usr/share/OVMF/OVMF_CODE_4M.fd"
    nvram = os_el.find("nvram")
    assert nvram.get("template") == "/usr/share/OVMF/OVMF_VARS_4M.fd"
    assert nvram.text == "/var/lib/libvirt/qemu/nvram/vm_VARS.fd"
    # Secure Boot must not be requested any other way either.
    assert root.find(".//firmware") is None
    assert root.find("features/smm") is None


def test_no_tpm_and_no_balloon() -> None:
    root = _parse(_spec())
    assert root.find(".//tpm") is None
    balloons = root.findall("devices/memballoon")
    assert [b.get("model") for b in balloons] == ["none"]


def test_vfio_hostdevs_for_gpus_then_fabric_vfs() -> None:
    root = _parse(_spec())
    hostdevs = root.findall("devices/hostdev")
    assert len(hostdevs) == 3
    addresses = []
    for hd in hostdevs:
        assert (hd.get("mode"), hd.get("type"), hd.get("managed")) == ("subsystem", "pci", "no")
        assert hd.find("driver").get("name") == "vfio"
        a = hd.find("source/address")
        addresses.append((a.get("domain"), a.get("bus"), a.get("slot"), a.get("function")))
    assert addresses == [
        ("0x0000", "0x18", "0x00", "0x0"),
        ("0x0000", "0x3b", "0x00", "0x0"),
        ("0x0000", "0x29", "0x00", "0x2"),
    ]


def test_raw_nvme_block_disk() -> None:
    root = _parse(_spec())
    disks = [d for d in root.findall("devices/disk") if d.get("device") == "disk"]
    assert len(disks) == 1
    disk = disks[0]
    assert disk.get("type") == "block"
    drv = disk.find("driver")
    assert drv.attrib == {"name": "qemu", "type": "raw", "cache": "none", "io": "native", "discard": "unmap"}
    assert disk.find("source").attrib == {"dev": DISK}
    assert disk.find("target").attrib == {"dev": "vda", "bus": "virtio"}
    assert disk.find("boot").get("order") == "1"


def test_file_stand_in_disk_uses_file_source() -> None:
    root = _parse(_spec(nvme_by_id=["/srv/sim/nvme0.img", "/srv/sim/nvme1.img"]))
    disks = [d for d in root.findall("devices/disk") if d.get("device") == "disk"]
    assert [d.get("type") for d in disks] == ["file", "file"]
    assert [d.find("source").attrib for d in disks] == [{"file": "/srv/sim/nvme0.img"}, {"file": "/srv/sim/nvme1.img"}]
    assert [d.find("target").get("dev") for d in disks] == ["vda", "vdb"]
    # An explicit type (the caller stat()ed the path) wins over the path heuristic.
    root = _parse(_spec(nvme_by_id=["/srv/sim/nvme0.img"], disk_source_type="block"))
    assert root.find("devices/disk[@device='disk']/source").attrib == {"dev": "/srv/sim/nvme0.img"}


def test_seed_cdrom_is_readonly() -> None:
    root = _parse(_spec())
    cdroms = [d for d in root.findall("devices/disk") if d.get("device") == "cdrom"]
    assert len(cdroms) == 1
    cd = cdroms[0]
    assert cd.get("type") == "file"
    assert cd.find("source").get("file") == "/var/lib/gpuaas/seeds/vm.iso"
    assert cd.find("readonly") is not None


def test_ovs_interface_with_slot_mac() -> None:
    spec = _spec()
    root = _parse(spec)
    nics = root.findall("devices/interface")
    assert len(nics) == 1
    nic = nics[0]
    assert nic.get("type") == "bridge"
    assert nic.find("mac").get("address") == "52:54:00:ab:cd:01"
    assert nic.find("source").get("bridge") == "ovsbr0"
    assert nic.find("virtualport").get("type") == "openvswitch"
    assert nic.find("model").get("type") == "virtio"
    # The port the agent marks protected once the tap exists: named, stable, within 15 characters.
    assert nic.find("target").get("dev") == tap_name(spec.vm_name) and len(tap_name(spec.vm_name)) <= 15
    assert nic.find("port") is None  # libvirt isolates Linux bridge ports only


def test_a_linux_bridge_port_is_isolated_so_slices_never_reach_each_other() -> None:
    nic = _parse(_spec(bridge_kind="linux", bridge="gpubr0")).find("devices/interface")
    assert nic.find("port").get("isolated") == "yes"
    assert nic.find("virtualport") is None


def test_tap_names_differ_per_vm_and_avoid_libvirts_prefix() -> None:
    names = {tap_name(f"slice-{i}") for i in range(1000)}
    assert len(names) == 1000 and not any(n.startswith(("vnet", "macvtap")) for n in names)


def test_hugepages_numa_and_pinning_when_asked() -> None:
    root = _parse(_spec())
    backing = root.find("memoryBacking")
    assert backing.find("hugepages/page").attrib == {"size": "1", "unit": "GiB"}
    assert backing.find("locked") is not None
    assert root.find("numatune/memory").attrib == {"mode": "strict", "nodeset": "1"}
    pins = {p.get("vcpu"): p.get("cpuset") for p in root.findall("cputune/vcpupin")}
    assert pins == {"0": "48", "1": "49", "2": "50", "3": "51"}
    assert root.find("cputune/emulatorpin").get("cpuset") == "48-51"


def test_small_cpuset_floats_vcpus_over_the_set() -> None:
    root = _parse(_spec(cpuset="48-49"))
    assert {p.get("cpuset") for p in root.findall("cputune/vcpupin")} == {"48-49"}


def test_no_tuning_elements_when_not_asked() -> None:
    root = _parse(_spec(hugepages=False, numa_node=None, cpuset=None))
    assert root.find("memoryBacking") is None
    assert root.find("numatune") is None
    assert root.find("cputune") is None
    assert root.find("vcpu").get("cpuset") is None


def test_values_are_escaped_not_templated() -> None:
    root = _parse(_spec(seed_iso_path="/seeds/a'b\"<c>&.iso"))
    assert root.find("devices/disk[@device='cdrom']/source").get("file") == "/seeds/a'b\"<c>&.iso"


# --- a real libvirt driver accepts it ---------------------------------------------------------------------


@pytest.mark.parametrize("tuned", [True, False])
def test_libvirt_test_driver_accepts_the_xml(tuned: bool) -> None:
    spec = _spec() if tuned else _spec(hugepages=False, numa_node=None, cpuset=None, gpus=[], fabric_vfs=[])
    conn = libvirt.open("test:///default")
    try:
        dom = conn.defineXML(render_domain_xml(spec))
        try:
            defined = ET.fromstring(dom.XMLDesc())
            assert defined.findtext("name") == spec.vm_name
            assert defined.find("os/loader").get("secure") == "no"
            assert len(defined.findall("devices/hostdev")) == len(spec.gpus) + len(spec.fabric_vfs)
            assert defined.find("devices/interface/virtualport").get("type") == "openvswitch"
            assert defined.find(".//tpm") is None
        finally:
            dom.undefine()
    finally:
        conn.close()


# --- the lab's shape: an emulated guest on a Linux bridge, nothing passed through ---------------------


def test_a_lab_guest_is_emulated_on_a_linux_bridge_with_no_hostdev_and_a_kept_console() -> None:
    spec = _spec(
        gpus=[],
        fabric_vfs=[],
        hugepages=False,
        numa_node=None,
        cpuset=None,
        domain_type="qemu",
        bridge_kind="linux",
        bridge="gpubr0",
        console_log_path="/var/lib/gpuaas/seeds/vm.console.log",
    )
    dom = _parse(spec)
    assert dom.get("type") == "qemu"
    assert dom.find("cpu").get("mode") == "maximum"  # TCG cannot pass a host CPU through
    assert dom.findall("devices/hostdev") == []
    nic = dom.find("devices/interface")
    assert nic.find("source").get("bridge") == "gpubr0" and nic.find("virtualport") is None
    assert dom.find("devices/serial/log").get("file") == "/var/lib/gpuaas/seeds/vm.console.log"


def test_production_xml_keeps_kvm_host_cpu_ovs_and_no_console_log_unless_asked() -> None:
    dom = _parse(_spec())
    assert dom.get("type") == "kvm" and dom.find("cpu").get("mode") == "host-passthrough"
    assert dom.find("devices/interface/virtualport").get("type") == "openvswitch"
    assert dom.find("devices/serial/log") is None
    assert len(dom.findall("devices/hostdev")) == 3


def test_the_seed_cd_sits_on_virtio_scsi_which_cloud_kernels_can_see() -> None:
    dom = _parse(_spec())
    cd = next(d for d in dom.findall("devices/disk") if d.get("device") == "cdrom")
    assert cd.find("target").get("bus") == "scsi"
    assert dom.find("devices/controller[@type='scsi']").get("model") == "virtio-scsi"


def test_passthrough_on_an_emulated_guest_is_refused() -> None:
    with pytest.raises(ValidationError, match="needs domain type kvm"):
        _spec(domain_type="qemu")


# --- the console: gatewayed, never a raw VNC or SPICE port ----------------------------------------------


@pytest.mark.parametrize("shape", ["production", "lab"])
def test_no_graphical_console_is_ever_exposed_as_libvirt_defines_it(shape: str) -> None:
    """The slice terminal is the only interactive way in (an SSH PTY relayed and audited by the control plane):
    the domain has no <graphics> (VNC/SPICE listen on a host port), no SPICE channel and no video device, as
    written and as libvirt defines it (it adds defaults of its own to what it is given); its serial console is a
    host-local pty only the agent can open."""
    spec = (
        _spec()
        if shape == "production"
        else _spec(gpus=[], fabric_vfs=[], domain_type="qemu", bridge_kind="linux", console_log_path="/var/log/c")
    )
    xml = render_domain_xml(spec)
    conn = libvirt.open("test:///default")
    try:
        dom = conn.defineXML(xml)
        try:
            defined = dom.XMLDesc()
        finally:
            dom.undefine()
    finally:
        conn.close()
    for text in (xml, defined):
        root = ET.fromstring(text)
        assert root.findall("devices/graphics") == []
        assert root.findall("devices/video") == []
        assert [c for c in root.findall("devices/channel") if c.get("type") == "spicevmc"] == []
        assert "vnc" not in text.lower() and "spice" not in text.lower()
        assert [s.get("type") for s in root.findall("devices/serial")] == ["pty"]
        assert [c.get("type") for c in root.findall("devices/console")] == ["pty"]
