"""Description of a (simulated) fleet: hosts, their approved slot bundles, and baremetal machines.

The scheduler seeds its inventory from it, the simulated node agents build their hosts from it and
the MAAS simulator its machines, so the three agree on ids without reading each other's state.
"""

from __future__ import annotations

import hashlib
import ipaddress
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from .profiles import DEFAULT_PROFILE

# H200 SXM slots on an XE9680L-like host: 8 GPUs behind 4 PCIe switches on 2 NUMA nodes.
_GPU_BUSES = ("18", "2a", "3a", "5d", "9a", "ab", "ba", "db")


class FleetSlot(BaseModel):
    model_config = ConfigDict(extra="forbid")

    slot_id: str
    gpu_pci_address: str
    numa_node: int
    pcie_switch: str
    nvme_by_id: str
    fabric_claim_mode: Literal["per_slot_vf", "shared"] = "per_slot_vf"
    fabric_vf_pci_address: str | None
    mac: str
    private_ip: str
    ovs_bridge: str = "ovsbr0"
    profile: str = DEFAULT_PROFILE


class FleetNode(BaseModel):
    model_config = ConfigDict(extra="forbid")

    node_id: str
    kind: Literal["slice_host", "baremetal"]
    hostname: str
    region: str = "default"
    pool: str = "default"
    sku: str
    maas_system_id: str | None = None
    host_root: str | None = None
    slots: list[FleetSlot] = Field(default_factory=list)
    # False for a real host in the fleet (the dev stack's lab host): its own agent runs, the simulated fleet
    # starts none for it, and its slots come from its discovery alone.
    simulated: bool = True


class Fleet(BaseModel):
    model_config = ConfigDict(extra="forbid")

    nodes: list[FleetNode]
    ssh_port: int = 2222

    @classmethod
    def load(cls, path: str | Path) -> "Fleet":
        return cls.model_validate_json(Path(path).read_text())

    def dump(self, path: str | Path) -> None:
        Path(path).write_text(self.model_dump_json(indent=2))

    def node(self, node_id: str) -> FleetNode:
        for node in self.nodes:
            if node.node_id == node_id:
                return node
        raise KeyError(node_id)


def system_id_for(hostname: str) -> str:
    """A MAAS-like 6-character system id, stable for a hostname."""
    alphabet = "abcdefghijklmnopqrstuvwxyz0123456789"
    digest = int.from_bytes(hashlib.sha256(hostname.encode()).digest()[:8], "big")
    chars = []
    for _ in range(6):
        digest, idx = divmod(digest, len(alphabet))
        chars.append(alphabet[idx])
    return "".join(chars)


def generate_fleet(
    *,
    slice_hosts: int = 4,
    slots_per_host: int = 8,
    baremetal_hosts: int = 2,
    root_dir: Path | None = None,
    subnet: str = "127.100.0.0/16",
    ssh_port: int = 2222,
    region: str = "default",
) -> Fleet:
    """Slice host i gets IPs from the i-th /24 of `subnet` (loopback in tests and the dev stack)."""
    net = ipaddress.ip_network(subnet)
    if slots_per_host > len(_GPU_BUSES):
        raise ValueError(f"at most {len(_GPU_BUSES)} slots per host")
    nodes: list[FleetNode] = []
    for h in range(1, slice_hosts + 1):
        node_id = f"slice-{h:02d}"
        host_root = root_dir / node_id if root_dir else None
        slots = []
        for s in range(slots_per_host):
            eui = hashlib.sha256(f"{node_id}:nvme{s}".encode()).hexdigest()[:32]
            by_id = f"/dev/disk/by-id/nvme-eui.{eui}"
            slots.append(
                FleetSlot(
                    slot_id=f"{node_id}-s{s}",
                    gpu_pci_address=f"0000:{_GPU_BUSES[s]}:00.0",
                    numa_node=0 if s < 4 else 1,
                    pcie_switch=f"sw{s // 2}",
                    nvme_by_id=by_id,
                    fabric_vf_pci_address=f"0000:{0x29 + (s // 4) * 0x80:02x}:00.{(s % 4) + 1}",
                    mac="52:54:00:%02x:%02x:%02x" % (h >> 8 & 0xFF, h & 0xFF, s),
                    private_ip=str(net.network_address + h * 256 + 10 + s),
                )
            )
        nodes.append(
            FleetNode(
                node_id=node_id,
                kind="slice_host",
                hostname=node_id,
                region=region,
                sku="h200-sxm-slice",
                # A MAAS machine too: commissioning runs its slice firmware preflight.
                maas_system_id=system_id_for(node_id),
                host_root=str(host_root) if host_root else None,
                slots=slots,
            )
        )
    for b in range(1, baremetal_hosts + 1):
        hostname = f"bm-{b:02d}"
        nodes.append(
            FleetNode(
                node_id=hostname,
                kind="baremetal",
                hostname=hostname,
                region=region,
                sku="h200-sxm",
                maas_system_id=system_id_for(hostname),
            )
        )
    return Fleet(nodes=nodes, ssh_port=ssh_port)
