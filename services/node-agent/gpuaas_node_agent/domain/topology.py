"""Candidate slots from discovered devices: deterministic pairing and suggested MAC/IP/OVS values. Pure.

Suggestions are advisory (ops approve slots); they must still be stable, so the same host yields the same
map after a reboot renames its NVMe disks: everything is keyed on PCI addresses and by-id paths, never on
kernel names.
"""

from __future__ import annotations

import hashlib
import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar


@dataclass(frozen=True)
class GpuRef:
    pci_address: str
    numa_node: int | None
    pcie_switch: str | None = None


@dataclass(frozen=True)
class DiskRef:
    by_id: str
    numa_node: int | None


@dataclass(frozen=True)
class VfRef:
    pci_address: str
    numa_node: int | None


@dataclass(frozen=True)
class Candidate:
    index: int
    gpu: GpuRef | None  # None on an emulated slot
    nvme_by_id: str | None
    fabric_vf: str | None
    mac: str
    private_ip: str
    ovs_bridge: str
    ovs_port: str
    emulated: bool = False

    @property
    def missing(self) -> list[str]:
        wanted = (
            (("nvme", self.nvme_by_id),)
            if self.emulated
            else (("nvme", self.nvme_by_id), ("fabric_vf", self.fabric_vf))
        )
        return [name for name, value in wanted if not value]


def suggested_mac(node_id: str, gpu_pci_address: str) -> str:
    """Locally administered range libvirt uses (52:54:00), the rest from a hash of node and GPU."""
    digest = hashlib.sha256(f"{node_id}/{gpu_pci_address}".encode()).digest()
    return "52:54:00:%02x:%02x:%02x" % (digest[0], digest[1], digest[2])


def _numa_key(numa: int | None) -> int:
    return -1 if numa is None else numa


class _NumaPlaced(Protocol):
    @property
    def numa_node(self) -> int | None: ...


T = TypeVar("T", bound=_NumaPlaced)


def _take(pool: list[T], numa: int | None) -> T | None:
    """The first free item on the GPU's NUMA node, else the first free one at all (locality is best effort)."""
    for i, item in enumerate(pool):
        if item.numa_node == numa:
            return pool.pop(i)
    return pool.pop(0) if pool else None


def _host_addresses(bridge_cidr: str, first_host: int) -> list[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    iface = ipaddress.ip_interface(bridge_cidr)
    return [
        h for h in iface.network.hosts() if h != iface.ip and int(h) - int(iface.network.network_address) >= first_host
    ]


def pair_candidates(
    node_id: str,
    gpus: Sequence[GpuRef],
    disks: Sequence[DiskRef],
    vfs: Sequence[VfRef],
    *,
    ovs_bridge: str = "ovsbr0",
    bridge_cidr: str = "10.100.0.1/24",
    first_host: int = 10,
) -> list[Candidate]:
    hosts = _host_addresses(bridge_cidr, first_host)
    disk_pool = sorted(disks, key=lambda d: (_numa_key(d.numa_node), d.by_id))
    vf_pool = sorted(vfs, key=lambda v: (_numa_key(v.numa_node), v.pci_address))
    out: list[Candidate] = []
    seen_macs: set[str] = set()
    for index, gpu in enumerate(sorted(gpus, key=lambda g: (_numa_key(g.numa_node), g.pci_address))):
        disk = _take(disk_pool, gpu.numa_node)
        vf = _take(vf_pool, gpu.numa_node)
        mac = suggested_mac(node_id, gpu.pci_address)
        while mac in seen_macs:  # vanishingly rare; still never hand out one MAC twice on a host
            mac = suggested_mac(node_id, mac)
        seen_macs.add(mac)
        out.append(
            Candidate(
                index=index,
                gpu=gpu,
                nvme_by_id=disk.by_id if disk else None,
                fabric_vf=vf.pci_address if vf else None,
                mac=mac,
                private_ip=str(hosts[index]) if index < len(hosts) else "",
                ovs_bridge=ovs_bridge,
                ovs_port=f"gpuaas-s{index}",
            )
        )
    return out


def emulated_candidates(
    node_id: str,
    disks: Sequence[str],
    *,
    first_index: int = 0,
    ovs_bridge: str = "ovsbr0",
    bridge_cidr: str = "10.100.0.1/24",
    first_host: int = 10,
) -> list[Candidate]:
    """Slots of an emulated-slot host (the lab): one per disk the site declared, with a MAC and IP of its own
    and neither a GPU nor a fabric VF, so the domain the agent defines passes nothing through rather than
    something pretended. Keyed on the disk's by-id path, as GPU slots are on the GPU's address."""
    hosts = _host_addresses(bridge_cidr, first_host)
    out = []
    for offset, by_id in enumerate(sorted(disks)):
        index = first_index + offset
        out.append(
            Candidate(
                index=index,
                gpu=None,
                nvme_by_id=by_id,
                fabric_vf=None,
                mac=suggested_mac(node_id, by_id),
                private_ip=str(hosts[index]) if index < len(hosts) else "",
                ovs_bridge=ovs_bridge,
                ovs_port=f"gpuaas-s{index}",
                emulated=True,
            )
        )
    return out
