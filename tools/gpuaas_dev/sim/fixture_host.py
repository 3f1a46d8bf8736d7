"""Generated host roots: the sysfs, /dev, /proc and /etc of a described slice host, plus the few host tools
the agent runs (as tiny scripts answering from the description).

Tests build their hosts with it and the simulated fleet gives every simulated host one, so discovery, parity
and the disk preflight read the same layout a Dell XE9680L presents (see the host facts reference):
`/sys/bus/pci/devices` entries are relative symlinks into a PCIe-switch hierarchy, `driver` and `iommu_group`
are symlinks, NVMe disks are named by volatile kernel names and found by stable by-id links, native
multipath adds hidden `nvmeXcYnZ` nodes, and disk stand-ins under /dev are regular files.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import struct
from pathlib import Path

from pydantic import BaseModel, Field

from gpuaas_common.fleet import FleetNode

GPU_BUSES = ("18", "2a", "3a", "5d", "9a", "ab", "ba", "db")
# Root port bus per PCIe switch: two GPUs behind each of four switches, two switches per NUMA node.
_SWITCH_ROOT_BUS = (0x15, 0x37, 0x97, 0xB7)
FIXTURE_DATA = "var/lib/gpuaas-fixture"
MIB = 1 << 20


class Partition(BaseModel):
    number: int = Field(ge=1)
    mountpoint: str | None = None
    fstype: str = "ext4"


class NvmeDisk(BaseModel):
    ctrl: int = Field(ge=0, description="Kernel instance number: nvme<ctrl>n1. Not stable across reboots.")
    wwid: str = Field(description="eui.<hex> or uuid.<uuid>: what udev turns into the by-id link")
    pci_address: str
    numa_node: int = 0
    size_bytes: int = 3_840_755_982_336
    model: str = "Dell Ent NVMe CM7 U.2 RI 3.84TB"
    serial: str = "S0"
    partitions: list[Partition] = Field(default_factory=list)
    mountpoint: str | None = None
    os_disk: bool = False
    multipath_hidden_paths: bool = False
    dos_label: bool = False  # an old partition table left on an otherwise unmounted disk


class Gpu(BaseModel):
    pci_address: str
    numa_node: int
    switch: int
    device_id: str = "2335"
    driver: str = "vfio-pci"


class Nic(BaseModel):
    pci_address: str
    device_id: str
    numa_node: int
    totalvfs: int = 16
    numvfs: int = 0
    vf_device_id: str = "101e"
    ib_device: str | None = None
    link_layer: str = "InfiniBand"
    port_state: str = "4: ACTIVE"
    vf_driver: str = "vfio-pci"


class HostDescription(BaseModel):
    hostname: str = "xe9680l-01"
    gpus: list[Gpu]
    nics: list[Nic]
    nvme: list[NvmeDisk]
    # Runbook parity conditions; each flag breaks exactly one check when turned off.
    kvm: bool = True
    iommu_groups: bool = True
    vfio_modules: bool = True
    libvirtd_active: bool = True
    ovs_bridge: str | None = "ovsbr0"
    ovs_address: str = "10.100.0.1/24"
    dnsmasq_gpu_subnet: bool = True
    nat_rule: bool = True
    ip_forward: bool = True
    ipoib_netplan: bool = True
    fabric_address: str | None = "172.16.10.15/24"
    fabric_route: bool = True
    network_baseline: str | None = "gpuaas-slice-network-baseline"
    node_agent_active: bool = True
    hugepages_1g_total: int = 512
    hugepages_1g_free: int = 512
    disk_file_bytes: int = 64 * MIB


def eui_for(hostname: str, index: int) -> str:
    return "eui." + hashlib.sha256(f"{hostname}:nvme{index}".encode()).hexdigest()[:32]


def xe9680l(
    hostname: str = "xe9680l-01",
    *,
    data_disk_wwids: list[str] | None = None,
    mounted_share: bool = True,
    os_disk_ctrl: int = 4,
    **overrides: object,
) -> HostDescription:
    """8 × H200 behind 4 PCIe switches on 2 NUMA nodes, 2 × ConnectX-7 (IB, 4 VFs each), a BlueField-3,
    the BOSS OS disk and data NVMe disks. With `mounted_share` the last data disk carries a mounted child
    partition, as the lab host's /share disks did."""
    gpus = [
        Gpu(pci_address=f"0000:{bus}:00.0", numa_node=0 if i < 4 else 1, switch=i // 2)
        for i, bus in enumerate(GPU_BUSES)
    ]
    nics = [
        Nic(pci_address="0000:29:00.0", device_id="1021", numa_node=0, numvfs=4, ib_device="mlx5_0"),
        Nic(pci_address="0000:a9:00.0", device_id="1021", numa_node=1, numvfs=4, ib_device="mlx5_1"),
        Nic(
            pci_address="0000:bc:00.0",
            device_id="a2dc",
            numa_node=1,
            ib_device="mlx5_2",
            link_layer="Ethernet",
            vf_driver="mlx5_core",
        ),
        Nic(
            pci_address="0000:bc:00.1",
            device_id="a2dc",
            numa_node=1,
            ib_device="mlx5_3",
            link_layer="Ethernet",
            port_state="1: DOWN",
            vf_driver="mlx5_core",
        ),
    ]
    wwids = data_disk_wwids if data_disk_wwids is not None else [eui_for(hostname, i) for i in range(8)]
    ctrls = [c for c in range(len(wwids) + 1) if c != os_disk_ctrl][: len(wwids)]
    disks = [
        NvmeDisk(
            ctrl=os_disk_ctrl,
            wwid=eui_for(hostname, 99),
            pci_address="0000:03:00.0",
            numa_node=0,
            size_bytes=480_103_981_056,
            model="Dell BOSS-N1",
            serial="BOSS0",
            os_disk=True,
            partitions=[
                Partition(number=1, mountpoint="/boot/efi", fstype="vfat"),
                Partition(number=2, mountpoint="/"),
            ],
        ),
    ]
    for i, (ctrl, wwid) in enumerate(zip(ctrls, wwids, strict=True)):
        numa = 0 if i < len(wwids) / 2 else 1
        bus = (0x41 if numa == 0 else 0xC1) + i
        disks.append(
            NvmeDisk(
                ctrl=ctrl,
                wwid=wwid,
                pci_address=f"0000:{bus:02x}:00.0",
                numa_node=numa,
                serial=f"PHAZ{i:04d}",
                multipath_hidden_paths=i % 3 == 1,
            )
        )
    if mounted_share and len(disks) > 1:
        share = disks[-1]
        disks[-1] = share.model_copy(update={"partitions": [Partition(number=1, mountpoint=f"/share{share.ctrl}")]})
    desc = HostDescription(hostname=hostname, gpus=gpus, nics=nics, nvme=disks)
    return desc.model_copy(update=overrides) if overrides else desc


# --- generation ------------------------------------------------------------------------------------------


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def _symlink(link: Path, target: Path) -> None:
    """A relative symlink, as sysfs and udev make them."""
    link.parent.mkdir(parents=True, exist_ok=True)
    if link.is_symlink() or link.exists():
        link.unlink()
    os.symlink(os.path.relpath(target, link.parent), link)


def _script(path: Path, body: str) -> None:
    _write(path, "#!/bin/sh\n" + 'DATA="$(cd "$(dirname "$0")/../.." && pwd)/' + FIXTURE_DATA + '"\n' + body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)


class _Sysfs:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.sys = root / "sys"
        self.next_group = 10

    def pci(
        self,
        bdf: str,
        chain: list[str],
        *,
        vendor: str,
        device: str,
        cls: str,
        numa: int,
        driver: str | None,
        iommu: bool,
    ) -> Path:
        domain, bus = bdf.split(":")[0], bdf.split(":")[1]
        root_bus = chain[0].split(":")[1] if chain else bus
        d = self.sys / "devices" / f"pci{domain}:{root_bus}"
        for bridge in chain:
            d = d / bridge
            if not (d / "class").exists():
                for name, value in (
                    ("vendor", "0x8086"),
                    ("device", "0x352a"),
                    ("class", "0x060400"),
                    ("numa_node", str(numa)),
                ):
                    _write(d / name, value + "\n")
        d = d / bdf
        for name, value in (
            ("vendor", f"0x{vendor}"),
            ("device", f"0x{device}"),
            ("class", cls),
            ("numa_node", str(numa)),
            ("driver_override", "(null)"),
            ("uevent", f"DRIVER={driver or ''}\nPCI_ID={vendor.upper()}:{device.upper()}\nPCI_SLOT_NAME={bdf}"),
        ):
            _write(d / name, value + "\n")
        _symlink(self.sys / "bus/pci/devices" / bdf, d)
        if driver:
            drv = self.sys / "bus/pci/drivers" / driver
            drv.mkdir(parents=True, exist_ok=True)
            _symlink(d / "driver", drv)
            _symlink(drv / bdf, d)
        if iommu:
            group = self.sys / "kernel/iommu_groups" / str(self.next_group)
            self.next_group += 1
            _symlink(d / "iommu_group", group)
            _symlink(group / "devices" / bdf, d)
        return d


def build_host_root(root: str | os.PathLike[str], desc: HostDescription) -> Path:
    """Write the host tree under `root`. Rebuilding an existing root refreshes /sys, /proc and /etc but keeps
    the disk stand-ins' contents: a simulated host keeps its disks across an agent restart."""
    root = Path(root)
    for generated in ("sys", "proc", FIXTURE_DATA, "dev/disk/by-id"):
        shutil.rmtree(root / generated, ignore_errors=True)
    fs = _Sysfs(root)
    sysroot = fs.sys
    if desc.iommu_groups:
        (sysroot / "kernel/iommu_groups").mkdir(parents=True, exist_ok=True)

    # GPUs behind PCIe switches: root port → switch upstream port → downstream port → GPU.
    downstream_slot: dict[int, int] = {}
    for gpu in desc.gpus:
        rb = _SWITCH_ROOT_BUS[gpu.switch % len(_SWITCH_ROOT_BUS)]
        slot = downstream_slot.get(gpu.switch, 0)
        downstream_slot[gpu.switch] = slot + 1
        chain = [f"0000:{rb:02x}:01.0", f"0000:{rb + 1:02x}:00.0", f"0000:{rb + 2:02x}:{slot:02x}.0"]
        fs.pci(
            gpu.pci_address,
            chain,
            vendor="10de",
            device=gpu.device_id,
            cls="0x030200",
            numa=gpu.numa_node,
            driver=gpu.driver,
            iommu=desc.iommu_groups,
        )

    for nic in desc.nics:
        bus = int(nic.pci_address.split(":")[1], 16)
        chain = [f"0000:{bus - 2:02x}:01.0"]
        pf = fs.pci(
            nic.pci_address,
            chain,
            vendor="15b3",
            device=nic.device_id,
            cls="0x020700" if nic.link_layer == "InfiniBand" else "0x020000",
            numa=nic.numa_node,
            driver="mlx5_core",
            iommu=desc.iommu_groups,
        )
        _write(pf / "sriov_totalvfs", f"{nic.totalvfs}\n")
        _write(pf / "sriov_numvfs", f"{nic.numvfs}\n")
        _write(pf / "sriov_vf_device", f"{nic.vf_device_id}\n")
        base = nic.pci_address[:-1]
        for n in range(nic.numvfs):
            vf_bdf = f"{base}{n + 1}"
            vf = fs.pci(
                vf_bdf,
                chain,
                vendor="15b3",
                device=nic.vf_device_id,
                cls="0x020700",
                numa=nic.numa_node,
                driver=nic.vf_driver,
                iommu=desc.iommu_groups,
            )
            _symlink(pf / f"virtfn{n}", vf)
            _symlink(vf / "physfn", pf)
        if nic.ib_device:
            ib = pf / "infiniband" / nic.ib_device
            _write(ib / "ports/1/state", nic.port_state + "\n")
            _write(ib / "ports/1/link_layer", nic.link_layer + "\n")
            _symlink(ib / "device", pf)
            _symlink(sysroot / "class/infiniband" / nic.ib_device, ib)
        if nic.device_id == "a2dc" and nic.pci_address.endswith(".0"):
            # The BF3 SoC management function: a DMA controller, not a fabric device.
            fs.pci(
                f"{base}2",
                chain,
                vendor="15b3",
                device="c2d5",
                cls="0x080100",
                numa=nic.numa_node,
                driver=None,
                iommu=desc.iommu_groups,
            )

    mounts = [
        "sysfs /sys sysfs rw,nosuid,nodev,noexec,relatime 0 0",
        "proc /proc proc rw,nosuid,nodev,noexec,relatime 0 0",
        "tmpfs /run tmpfs rw,nosuid,nodev,size=52428800k,mode=755 0 0",
    ]
    dev = root / "dev"
    for disk in desc.nvme:
        ctrl_dir = fs.pci(
            disk.pci_address,
            [f"0000:{int(disk.pci_address.split(':')[1], 16) - 1:02x}:01.0"],
            vendor="144d",
            device="a80a",
            cls="0x010802",
            numa=disk.numa_node,
            driver="nvme",
            iommu=desc.iommu_groups,
        )
        name = f"nvme{disk.ctrl}n1"
        nvme_ctrl = ctrl_dir / "nvme" / f"nvme{disk.ctrl}"
        _write(nvme_ctrl / "serial", disk.serial + "\n")
        _write(nvme_ctrl / "model", disk.model + "\n")
        _symlink(nvme_ctrl / "device", ctrl_dir)
        _symlink(sysroot / "class/nvme" / f"nvme{disk.ctrl}", nvme_ctrl)
        if disk.multipath_hidden_paths:
            # Native multipath: the namespace head is virtual, the per-controller path is hidden.
            head = sysroot / "devices/virtual/nvme-subsystem" / f"nvme-subsys{disk.ctrl}" / name
            hidden_name = f"nvme{disk.ctrl}c{disk.ctrl}n1"
            hidden = nvme_ctrl / hidden_name
            for attr, value in (("hidden", "1"), ("size", str(disk.size_bytes // 512)), ("wwid", disk.wwid)):
                _write(hidden / attr, value + "\n")
            _symlink(sysroot / "block" / hidden_name, hidden)
            _symlink(sysroot / "class/block" / hidden_name, hidden)
            _symlink(head / "device", sysroot / "devices/virtual/nvme-subsystem" / f"nvme-subsys{disk.ctrl}")
        else:
            head = nvme_ctrl / name
            _symlink(head / "device", nvme_ctrl)
        for attr, value in (
            ("hidden", "0"),
            ("size", str(disk.size_bytes // 512)),
            ("wwid", disk.wwid),
            ("removable", "0"),
            ("ro", "0"),
        ):
            _write(head / attr, value + "\n")
        (head / "holders").mkdir(parents=True, exist_ok=True)
        _symlink(sysroot / "block" / name, head)
        _symlink(sysroot / "class/block" / name, head)

        path = dev / name
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            with path.open("wb") as f:
                f.truncate(desc.disk_file_bytes)
                if disk.dos_label:
                    f.seek(446)
                    f.write(bytes([0, 0, 0, 0, 0x83, 0, 0, 0]) + struct.pack("<II", 2048, 4096))
                    f.seek(510)
                    f.write(b"\x55\xaa")
        by_id = dev / "disk/by-id"
        _symlink(by_id / f"nvme-{disk.wwid}", path)
        _symlink(by_id / f"nvme-{disk.model.replace(' ', '_')}_{disk.serial}", path)
        _symlink(by_id / f"nvme-{disk.model.replace(' ', '_')}_{disk.serial}_1", path)
        if disk.mountpoint:
            mounts.append(f"/dev/{name} {disk.mountpoint} ext4 rw,relatime 0 0")
        for part in disk.partitions:
            pname = f"{name}p{part.number}"
            _write(head / pname / "partition", f"{part.number}\n")
            _write(head / pname / "size", "2048\n")
            _symlink(sysroot / "class/block" / pname, head / pname)
            ppath = dev / pname
            if not ppath.exists():
                with ppath.open("wb") as f:
                    f.truncate(MIB)
            _symlink(by_id / f"nvme-{disk.wwid}-part{part.number}", ppath)
            if part.mountpoint:
                mounts.append(f"/dev/{pname} {part.mountpoint} {part.fstype} rw,relatime 0 0")

    if desc.kvm:
        _write(dev / "kvm", "")
    elif (dev / "kvm").exists():
        (dev / "kvm").unlink()
    (dev / "vfio").mkdir(parents=True, exist_ok=True)
    _write(dev / "vfio/vfio", "")

    modules = ["kvm", "kvm_intel", "mlx5_core", "nvme", "openvswitch"]
    if desc.vfio_modules:
        modules += ["vfio", "vfio_pci", "vfio_iommu_type1"]
    for module in modules:
        _write(sysroot / "module" / module / "refcnt", "0\n")

    hp = sysroot / "kernel/mm/hugepages/hugepages-1048576kB"
    _write(hp / "nr_hugepages", f"{desc.hugepages_1g_total}\n")
    _write(hp / "free_hugepages", f"{desc.hugepages_1g_free}\n")
    _write(sysroot / "kernel/mm/hugepages/hugepages-2048kB/free_hugepages", "0\n")

    proc = root / "proc"
    _write(proc / "mounts", "\n".join(mounts) + "\n")
    _write(proc / "swaps", "Filename\t\t\t\tType\t\tSize\t\tUsed\t\tPriority\n")
    _write(proc / "cmdline", "BOOT_IMAGE=/vmlinuz root=UUID=0 ro intel_iommu=on iommu=pt\n")
    _write(proc / "sys/net/ipv4/ip_forward", "1\n" if desc.ip_forward else "0\n")
    _write(proc / "sys/kernel/hostname", desc.hostname + "\n")

    etc = root / "etc"
    for stale in (etc / "netplan/60-ipoib.yaml", etc / "dnsmasq.d/gpuaas-slice.conf"):
        if stale.exists():
            stale.unlink()
    fabric_if = "ibp24s0"
    if desc.ipoib_netplan:
        _write(
            etc / "netplan/60-ipoib.yaml",
            f"network:\n  version: 2\n  ethernets:\n    {fabric_if}:\n      addresses: [{desc.fabric_address}]\n",
        )
    if desc.dnsmasq_gpu_subnet:
        _write(
            etc / "dnsmasq.d/gpuaas-slice.conf",
            f"interface={desc.ovs_bridge or 'ovsbr0'}\nbind-interfaces\n"
            "dhcp-range=10.100.0.10,10.100.0.250,255.255.255.0,12h\n"
            "dhcp-option=option:router,10.100.0.1\ndhcp-hostsdir=/etc/gpuaas/dnsmasq-hosts\n",
        )
    _write(etc / "hostname", desc.hostname + "\n")

    # What `ip`, `iptables` and `systemctl` would say on this host.
    data = root / FIXTURE_DATA
    links = [
        {"ifname": "lo", "addr_info": [{"family": "inet", "local": "127.0.0.1", "prefixlen": 8}]},
        {"ifname": "eno8303", "addr_info": [{"family": "inet", "local": "10.177.36.197", "prefixlen": 24}]},
    ]
    routes = [
        {"dst": "default", "gateway": "10.177.36.1", "dev": "eno8303"},
        {"dst": "10.177.36.0/24", "dev": "eno8303", "prefsrc": "10.177.36.197"},
    ]
    if desc.ovs_bridge:
        addr, plen = desc.ovs_address.split("/")
        links.append(
            {"ifname": desc.ovs_bridge, "addr_info": [{"family": "inet", "local": addr, "prefixlen": int(plen)}]}
        )
        _write(sysroot / "class/net" / desc.ovs_bridge / "address", "0e:5a:11:00:00:01\n")
        _write(sysroot / "class/net" / desc.ovs_bridge / "operstate", "unknown\n")
    if desc.fabric_address:
        addr, plen = desc.fabric_address.split("/")
        links.append({"ifname": fabric_if, "addr_info": [{"family": "inet", "local": addr, "prefixlen": int(plen)}]})
        if desc.fabric_route:
            net = ".".join(addr.split(".")[:3]) + ".0"
            routes.append({"dst": f"{net}/{plen}", "dev": fabric_if, "prefsrc": addr})
    _write(data / "ip-addr.json", json.dumps(links))
    _write(data / "ip-route.json", json.dumps(routes))
    nat = ["-P POSTROUTING ACCEPT"]
    if desc.nat_rule:
        nat.append("-A POSTROUTING -s 10.100.0.0/24 -j MASQUERADE")
    _write(data / "iptables-nat-POSTROUTING.txt", "\n".join(nat) + "\n")
    active = ["openvswitch-switch", "dnsmasq", "rshim"]
    if desc.libvirtd_active:
        active.append("libvirtd")
    if desc.network_baseline:
        active.append(desc.network_baseline)
    if desc.node_agent_active:
        active.append("gpuaas-node-agent")
    _write(data / "active-units.txt", "\n".join(active) + "\n")

    sbin = root / "usr/sbin"
    _script(
        sbin / "ip",
        'case "$*" in\n  "-j addr show") cat "$DATA/ip-addr.json";;\n'
        '  "-j route show") cat "$DATA/ip-route.json";;\n'
        '  *) echo "fixture ip: unsupported: $*" >&2; exit 1;;\nesac\n',
    )
    _script(
        sbin / "iptables",
        'if [ "$*" = "-t nat -S POSTROUTING" ]; then cat "$DATA/iptables-nat-POSTROUTING.txt";'
        ' else echo "fixture iptables: unsupported: $*" >&2; exit 2; fi\n',
    )
    _script(
        root / "usr/bin/systemctl",
        'if [ "$1" != "is-active" ]; then echo "fixture systemctl: unsupported: $*" >&2; exit 1; fi\n'
        'unit="${2%.service}"\n'
        'if grep -qx "$unit" "$DATA/active-units.txt"; then echo active; exit 0; fi\n'
        "echo inactive; exit 3\n",
    )
    # Signature probes are the real tools: they read the disk stand-ins like they read a device.
    for tool in ("wipefs", "blkid"):
        real = shutil.which(tool)
        if real:
            link = sbin / tool
            if link.is_symlink() or link.exists():
                link.unlink()
            os.symlink(real, link)
    return root


def describe_fleet_node(node: FleetNode, *, disk_file_bytes: int = 64 * MIB) -> HostDescription:
    """The host a simulated fleet node runs on: its slots' disks become the data NVMe disks, so discovery on
    the simulated host finds exactly the by-id paths the fleet approved."""
    wwids = [slot.nvme_by_id.rsplit("/", 1)[-1].removeprefix("nvme-") for slot in node.slots]
    return xe9680l(node.hostname, data_disk_wwids=wwids, mounted_share=False, disk_file_bytes=disk_file_bytes)
