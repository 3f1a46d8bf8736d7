"""Seeding nodes and slot candidates from the fleet file.

A fleet file says which hosts exist and which slot bundles they are meant to carry; it proves nothing
about a host's disks, parity or commissioning. So seeding registers the nodes (parity unknown, no
preflight) and records the bundles only as candidates (`source = 'fleet-seed'`, no disk evidence, not
approved): nothing seeded is placeable. A slot becomes `available` only the way any real one does: the
host's agent reports its topology (which replaces these candidates with what it found, disk evidence
included), its parity run passes, and ops approve the candidates through the admin API.
"""

from __future__ import annotations

import asyncpg

from gpuaas_common.contract import HostMode
from gpuaas_common.fleet import Fleet

from ..host_modes import record_created
from .capacity import refresh_nodes

TAG_SLICE, TAG_BAREMETAL = "gpuaas-profile-slice-vm", "gpuaas-profile-baremetal"
SEED_SOURCE = "fleet-seed"
_CANDIDATE_COLUMNS = (
    "candidate_id",
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
)


async def seed_from_fleet(conn: asyncpg.Connection, fleet: Fleet) -> int:
    """Insert nodes and candidates that are not there yet; never touches existing rows (a restart must not
    undo discovery, approval or a mode change). Returns how many candidates were added."""
    added = 0
    created: list[str] = []
    for node in fleet.nodes:
        intent = "slice-vm" if node.kind == "slice_host" else "baremetal"
        # parity_failures, parity_checked_at and preflight_status stay NULL: unknown until the agent's
        # parity run and the MAAS commissioning preflight report them.
        inserted_node = await conn.fetchval(
            "INSERT INTO nodes (node_id, kind, hostname, region, pool, sku, maas_system_id, profile_intent, "
            "maas_tags, mode) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10) ON CONFLICT (node_id) DO NOTHING "
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
            HostMode.SLICE if node.kind == "slice_host" else HostMode.BAREMETAL,
        )
        if inserted_node:
            created.append(inserted_node)
        rows = [
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
            )
            for slot in node.slots
        ]
        if rows:
            # Only on a node seeded just now: on an existing one, discovery may already have replaced them.
            inserted = await conn.fetch(
                f"INSERT INTO candidate_slots ({', '.join(_CANDIDATE_COLUMNS)}, source) "
                "SELECT r.*, $13 FROM unnest($1::text[], $2::text[], $3::text[], $4::int[], $5::text[], $6::text[], "
                "$7::text[], $8::text[], $9::text[], $10::text[], $11::text[], $12::text[]) AS r "
                "WHERE $14 ON CONFLICT DO NOTHING RETURNING candidate_id",
                *[list(col) for col in zip(*rows, strict=True)],
                SEED_SOURCE,
                bool(inserted_node),
            )
            added += len(inserted)
    await record_created(conn, created, SEED_SOURCE, "mode from the fleet file's host kind")
    await refresh_nodes(conn, [n.node_id for n in fleet.nodes])
    return added
