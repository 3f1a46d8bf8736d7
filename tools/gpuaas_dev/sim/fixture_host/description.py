"""What a simulated slice host is made of (GPUs, NICs, NVMe disks, parity flags) and the stock descriptions:
a Dell XE9680L with 8 × H200, and the host behind a simulated fleet node."""

from __future__ import annotations

import hashlib
import ipaddress

from pydantic import BaseModel, Field

from gpuaas_common.fleet import FleetNode

GPU_BUSES = ("18", "2a", "3a", "5d", "9a", "ab", "ba", "db")
# Module IDs in bus order, as the one real system of the partitions reference numbers its board: the two GPUs
# behind a PCIe switch are a valid NVLink pair ({1,3}, {2,4}, {5,7}, {6,8}), each NUMA node holds a half.
GPU_MODULES = (1, 3, 2, 4, 5, 7, 6, 8)
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
    # What `nvidia-smi -q` prints as its Module Id; None prints N/A (a board without module IDs).
    module_id: int | None = None


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
    # The subnet the network baseline rendered dnsmasq and the NAT rule for; None: the bridge's own. Set apart
    # from `ovs_address` to model a bridge that lost (or never got) the baseline's address.
    baseline_cidr: str | None = None
    dnsmasq_gpu_subnet: bool = True
    nat_rule: bool = True
    ip_forward: bool = True
    ipoib_netplan: bool = True
    fabric_address: str | None = "172.16.10.15/24"
    fabric_route: bool = True
    network_baseline: str | None = "gpuaas-slice-network-baseline"
    node_agent_active: bool = True
    # Device binding in slice mode: GPUs and fabric VFs stay on vfio-pci under persistent driverctl overrides,
    # host GPU services quiesced. `nvidia_bound_gpus` puts the first N GPUs back on the host driver (drift).
    driverctl_overrides: bool = True
    nvidia_bound_gpus: int = 0
    nvidia_persistenced_active: bool = False
    # A slice host runs Fabric Manager in shared-NVSwitch mode (issue 29): it activates NVLink partitions.
    fabricmanager_active: bool = True
    fabricmanager_mode: int = 1  # FABRIC_MODE in fabricmanager.cfg: 0 bare metal (holds the GPUs), 1 shared NVSwitch
    # What `nv-fabricmanager --version` prints; None: no Fabric Manager binary on the host.
    fabricmanager_version: str | None = "550.127.05"
    # Whether the host has `nvidia-smi` (the driver's tools): without it discovery reports no module IDs.
    nvidia_smi: bool = True
    # The rest of the runbook's slice baseline.
    slice_services: tuple[str, ...] = (
        "gpuaas-slice-fabric-vfs",
        "gpuaas-slice-vfio-devices",
        "gpuaas-slice-ovs-bridge",
    )
    dnsmasq_active: bool = True
    h200_ib_done: bool = True
    tmfifo_address: str | None = "192.168.100.1/30"
    # The BlueField-3's end of the RShim link answers ping (it cannot without the host's tmfifo_net0 address).
    bf3_peer_reachable: bool = True
    reboot_required: bool = False
    # 1 GiB hugepages staged for the tuned runtime profile (the prototype's 512 = 64 per GPU). 0: a host
    # without hugepages; None: a kernel with no 1 GiB pool at all (its sysfs directory is absent).
    hugepages_1g_total: int | None = 512
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
        Gpu(pci_address=f"0000:{bus}:00.0", numa_node=0 if i < 4 else 1, switch=i // 2, module_id=GPU_MODULES[i])
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


def fleet_bridge_cidr(node: FleetNode) -> str | None:
    """The GPU bridge address of a simulated fleet host: .1 of the /24 its slots' IPs are in.

    Real hosts all use the runbook's 10.100.0.1/24 behind NAT; simulated hosts share one network namespace
    and their guests must answer on loopback, so each gets its own loopback /24 (the fleet's)."""
    if not node.slots:
        return None
    net = ipaddress.ip_network(f"{node.slots[0].private_ip}/24", strict=False)
    return f"{net.network_address + 1}/{net.prefixlen}"


def describe_fleet_node(node: FleetNode, *, disk_file_bytes: int = 64 * MIB) -> HostDescription:
    """The host a simulated fleet node runs on: its slots' disks become the data NVMe disks and its GPU
    bridge carries the fleet's subnet, so discovery on the simulated host finds the by-id paths and
    suggests the IPs the fleet file describes."""
    wwids = [slot.nvme_by_id.rsplit("/", 1)[-1].removeprefix("nvme-") for slot in node.slots]
    cidr = fleet_bridge_cidr(node)
    extra: dict[str, object] = {"ovs_address": cidr} if cidr else {}
    return xe9680l(node.hostname, data_disk_wwids=wwids, mounted_share=False, disk_file_bytes=disk_file_bytes, **extra)
