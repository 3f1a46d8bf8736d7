"""Bulk synthetic inventory (XE9680L-like hosts: 8 GPUs, 4 PCIe switches, 2 NUMA nodes) for the
benchmark and the tests; COPY keeps a 5,000-node fleet to a second or two."""

from __future__ import annotations

import hashlib

import asyncpg

from gpuaas_common.profiles import hugepages_1g_needed

from .inventory import TAG_BAREMETAL, TAG_SLICE, refresh_nodes

# Synthetic fleets stand in for hosts whose discovery and approval already happened: their disks are
# described as a clean raw NVMe would be. Only tests and benchmarks build them; never the dev stack.
SIMULATED_CLEAN_DISK = {"mounted": False, "mounted_children": [], "signatures": [], "is_os_disk": False}

_BUSES = ("18", "2a", "3a", "5d", "9a", "ab", "ba", "db")
PROFILE = "h200_1g_24c_64g"


def slot_row(node_id: str, n: int, s: int) -> dict:
    eui = hashlib.sha256(f"{node_id}:nvme{s}".encode()).hexdigest()[:32]
    return {
        "slot_id": f"{node_id}-s{s}",
        "node_id": node_id,
        "gpu_pci_address": f"0000:{_BUSES[s]}:00.0",
        "numa_node": 0 if s < 4 else 1,
        "pcie_switch": f"sw{s // 2}",
        "nvme_by_id": f"/dev/disk/by-id/nvme-eui.{eui}",
        "fabric_claim_mode": "per_slot_vf",
        "fabric_vf_pci_address": f"0000:{0x29 + (s // 4) * 0x80:02x}:00.{(s % 4) + 1}",
        "mac": "52:54:%02x:%02x:%02x:%02x" % (n >> 16 & 0xFF, n >> 8 & 0xFF, n & 0xFF, s),
        "private_ip": f"10.{100 + (n >> 8)}.{n & 0xFF}.{10 + s}",
        "ovs_bridge": "ovsbr0",
        "profile": PROFILE,
        "status": "available",
        "nvme_evidence": SIMULATED_CLEAN_DISK,
    }


async def build(
    conn: asyncpg.Connection,
    *,
    slice_hosts: int,
    slots_per_host: int = 8,
    baremetal_hosts: int = 0,
    convertible: bool = False,
    region: str = "default",
    sku: str = "h200-sxm-slice",
    baremetal_sku: str = "h200-sxm",
    prefix: str = "n",
) -> list[str]:
    """Slice hosts `<prefix>00001…` (parity-clean, commissioning preflight passed, 1 GiB hugepages for every
    slot's profile reported, every slot approved) and baremetal hosts `bm…`. With `convertible`, slice hosts
    also carry the baremetal tag."""
    import json

    tags = [TAG_SLICE, TAG_BAREMETAL] if convertible else [TAG_SLICE]
    hugepages = hugepages_1g_needed(PROFILE, slots_per_host)
    nodes = [
        (
            f"{prefix}{i:05d}",
            "slice_host",
            f"{prefix}{i:05d}",
            region,
            "default",
            sku,
            None,
            "slice-vm",
            tags,
            "slice",
            0,
            "passed",
            hugepages,
            hugepages,
        )
        for i in range(1, slice_hosts + 1)
    ] + [
        (
            f"bm{i:05d}",
            "baremetal",
            f"bm{i:05d}",
            region,
            "default",
            baremetal_sku,
            f"sys{i:05d}",
            "baremetal",
            [TAG_BAREMETAL],
            "baremetal",
            None,
            None,
            None,
            None,
        )
        for i in range(1, baremetal_hosts + 1)
    ]
    await conn.copy_records_to_table(
        "nodes",
        records=nodes,
        columns=[
            "node_id",
            "kind",
            "hostname",
            "region",
            "pool",
            "sku",
            "maas_system_id",
            "profile_intent",
            "maas_tags",
            "mode",
            "parity_failures",
            "preflight_status",
            "hugepages_1g_total",
            "hugepages_1g_free",
        ],
    )
    cols = [
        "slot_id",
        "node_id",
        "gpu_pci_address",
        "numa_node",
        "pcie_switch",
        "nvme_by_id",
        "fabric_claim_mode",
        "fabric_vf_pci_address",
        "mac",
        "private_ip",
        "ovs_bridge",
        "profile",
        "status",
        "nvme_evidence",
    ]
    rows = []
    for i in range(1, slice_hosts + 1):
        for s in range(slots_per_host):
            r = slot_row(f"{prefix}{i:05d}", i, s)
            r["nvme_evidence"] = json.dumps(r["nvme_evidence"])
            rows.append(tuple(r[c] for c in cols))
    await conn.copy_records_to_table("node_resource_slots", records=rows, columns=cols)
    await refresh_nodes(conn)
    return [n[0] for n in nodes]
