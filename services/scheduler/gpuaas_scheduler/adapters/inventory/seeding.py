"""Seeding nodes and slots from the fleet file."""

from __future__ import annotations

import json

import asyncpg

from gpuaas_common.fleet import Fleet

from ...domain.slots import incomplete_reason
from ..host_modes import record_created
from .capacity import refresh_nodes

TAG_SLICE, TAG_BAREMETAL = "gpuaas-profile-slice-vm", "gpuaas-profile-baremetal"
# The simulated fleet's disks are generated empty and unmounted; real hosts report evidence through
# discovery and the admin API.
SIMULATED_CLEAN_DISK = {"mounted": False, "mounted_children": [], "signatures": [], "is_os_disk": False}


async def seed_from_fleet(conn: asyncpg.Connection, fleet: Fleet) -> int:
    """Insert nodes and slots that are not there yet; never touches the status of existing rows."""
    added = 0
    created: list[str] = []
    for node in fleet.nodes:
        intent = "slice-vm" if node.kind == "slice_host" else "baremetal"
        # The simulated fleet is generated parity-clean; a real host's agent reports its own.
        inserted_node = await conn.fetchval(
            "INSERT INTO nodes (node_id, kind, hostname, region, pool, sku, maas_system_id, profile_intent, "
            "maas_tags, mode, parity_failures, parity_checked_at) "
            "VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, now()) ON CONFLICT (node_id) DO NOTHING "
            "RETURNING node_id",
            node.node_id,
            node.kind,
            node.hostname,
            node.region,
            node.pool,
            node.sku,
            node.maas_system_id,
            intent,
            [TAG_SLICE if node.kind == "slice_host" else TAG_BAREMETAL],
            "slice" if node.kind == "slice_host" else "baremetal",
            0 if node.kind == "slice_host" else None,
        )
        if inserted_node:
            created.append(inserted_node)
        rows = []
        for slot in node.slots:
            data = slot.model_dump()
            reason = incomplete_reason(data)
            rows.append(
                (
                    slot.slot_id,
                    node.node_id,
                    slot.gpu_pci_address,
                    slot.numa_node,
                    slot.pcie_switch,
                    slot.nvme_by_id,
                    slot.fabric_claim_mode,
                    slot.fabric_vf_pci_address,
                    slot.mac,
                    slot.private_ip,
                    slot.ovs_bridge,
                    slot.profile,
                    "disabled" if reason else "available",
                    reason,
                    json.dumps(SIMULATED_CLEAN_DISK),
                )
            )
        if rows:
            inserted = await conn.fetch(
                "INSERT INTO node_resource_slots (slot_id, node_id, gpu_pci_address, numa_node, pcie_switch, "
                "nvme_by_id, fabric_claim_mode, fabric_vf_pci_address, mac, private_ip, ovs_bridge, profile, "
                "status, status_reason, nvme_evidence, approved_by, approved_at) "
                "SELECT r.*, 'fleet-seed', now() FROM unnest($1::text[], $2::text[], $3::text[], $4::int[], "
                "$5::text[], $6::text[], $7::text[], $8::text[], $9::text[], $10::text[], $11::text[], $12::text[], "
                "$13::text[], $14::text[], $15::jsonb[]) AS r "
                "ON CONFLICT (slot_id) DO NOTHING RETURNING slot_id",
                *[list(col) for col in zip(*rows, strict=True)],
            )
            added += len(inserted)
    await record_created(conn, created, "fleet-seed", "mode from the fleet file's host kind")
    await refresh_nodes(conn, [n.node_id for n in fleet.nodes])
    return added
