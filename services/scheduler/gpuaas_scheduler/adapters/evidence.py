"""Statements that record readiness evidence (see service_layer/evidence.py for the rules).

Each update applies only when newer than what is stored and than the host's last evidence reset;
each returns whether it applied."""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from typing import Any

import asyncpg

CANDIDATE_FIELDS = (
    "gpu_pci_address",
    "numa_node",
    "pcie_switch",
    "nvme_by_id",
    "fabric_claim_mode",
    "fabric_vf_pci_address",
    "mac",
    "private_ip",
    "ovs_bridge",
    "ovs_port",
    "emulated",
    "module_id",
)


async def update_parity(
    conn: asyncpg.Connection, node_id: str, failures: int, detail: dict[str, Any], checked_at: datetime
) -> bool:
    return (
        await conn.fetchrow(
            "UPDATE nodes SET parity_failures = $2, parity_detail = $3::jsonb, parity_checked_at = $4, "
            "parity_reported_at = $4, updated_at = now() "
            "WHERE node_id = $1 AND (parity_reported_at IS NULL OR parity_reported_at <= $4) "
            "AND (evidence_reset_at IS NULL OR evidence_reset_at < $4) RETURNING node_id",
            node_id,
            failures,
            json.dumps(detail),
            checked_at,
        )
        is not None
    )


async def update_topology(
    conn: asyncpg.Connection,
    node_id: str,
    discovered_at: datetime,
    blockers: list[Any],
    hugepages_1g_total: int | None = None,
    hugepages_1g_free: int | None = None,
    fabric_manager: tuple[str | None, str | None, bool | None] = (None, None, None),
) -> bool:
    """The hugepage counts and the Fabric Manager (mode, version, active) replace the stored ones even when
    None: a report without them leaves the host's capacity unknown, not as an older report said."""
    return (
        await conn.fetchrow(
            "UPDATE nodes SET topology_reported_at = $2, topology_blockers = $3::jsonb, hugepages_1g_total = $4, "
            "hugepages_1g_free = $5, fabric_manager_mode = $6, fabric_manager_version = $7, "
            "fabric_manager_active = $8, updated_at = now() "
            "WHERE node_id = $1 AND (topology_reported_at IS NULL OR topology_reported_at <= $2) "
            "AND (evidence_reset_at IS NULL OR evidence_reset_at < $2) RETURNING node_id",
            node_id,
            discovered_at,
            json.dumps(blockers),
            hugepages_1g_total,
            hugepages_1g_free,
            *fabric_manager,
        )
        is not None
    )


async def replace_unapproved_candidates(
    conn: asyncpg.Connection, node_id: str, rows: Sequence[tuple[Any, ...]]
) -> None:
    """rows: (candidate_id, node_id, *CANDIDATE_FIELDS, nvme_evidence json or None)."""
    await conn.execute("DELETE FROM candidate_slots WHERE node_id = $1 AND approved_slot_id IS NULL", node_id)
    if rows:
        cols = ", ".join(CANDIDATE_FIELDS)
        await conn.executemany(
            f"INSERT INTO candidate_slots (candidate_id, node_id, {cols}, nvme_evidence, source) "
            f"VALUES ($1, $2, {', '.join(f'${i + 3}' for i in range(len(CANDIDATE_FIELDS)))}, "
            f"${len(CANDIDATE_FIELDS) + 3}::jsonb, 'node-agent') ON CONFLICT DO NOTHING",
            rows,
        )


async def upsert_image_readiness(
    conn: asyncpg.Connection,
    node_id: str,
    slug: str,
    status: str,
    digest: str | None,
    schedulable: bool,
    reported_at: datetime,
) -> bool:
    return (
        await conn.fetchrow(
            "INSERT INTO node_image_readiness (node_id, slug, status, digest_sha256, schedulable, reported_at) "
            "VALUES ($1, $2, $3, $4, $5, $6) ON CONFLICT (node_id, slug) DO UPDATE SET status = EXCLUDED.status, "
            "digest_sha256 = EXCLUDED.digest_sha256, schedulable = EXCLUDED.schedulable, "
            "reported_at = EXCLUDED.reported_at, updated_at = now() "
            "WHERE node_image_readiness.reported_at <= EXCLUDED.reported_at RETURNING node_id",
            node_id,
            slug,
            status,
            digest,
            schedulable,
            reported_at,
        )
        is not None
    )


async def node_exists(conn: asyncpg.Connection, node_id: str) -> bool:
    return bool(await conn.fetchval("SELECT 1 FROM nodes WHERE node_id = $1", node_id))


async def node_for_machine(conn: asyncpg.Connection, system_id: str, node_id: str | None) -> str | None:
    """The scheduler node a MAAS machine is: by its system id (nodes carry maas_system_id), else by the
    node id the command named."""
    found = await conn.fetchval("SELECT node_id FROM nodes WHERE maas_system_id = $1", system_id)
    if found is None and node_id:
        found = await conn.fetchval("SELECT node_id FROM nodes WHERE node_id = $1", node_id)
    return found


async def insert_slice_preflight(conn: asyncpg.Connection, node_id: str | None, row: dict[str, Any]) -> bool:
    return (
        await conn.fetchval(
            "INSERT INTO node_slice_preflight (operation_id, node_id, site, system_id, result_set_id, script_name, "
            "script_status, exit_status, status, reasons, warnings, checks, nvme, reported_at) "
            "VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10::jsonb, $11::jsonb, $12::jsonb, $13::jsonb, $14) "
            "ON CONFLICT (operation_id) DO NOTHING RETURNING operation_id",
            row["operation_id"],
            node_id,
            row["site"],
            row["system_id"],
            row["result_set_id"],
            row["script_name"],
            row["script_status"],
            row["exit_status"],
            row["status"],
            json.dumps(row["reasons"]),
            json.dumps(row["warnings"]),
            json.dumps(row["checks"]),
            json.dumps(row["nvme"]),
            row["reported_at"],
        )
        is not None
    )


async def update_preflight(
    conn: asyncpg.Connection, node_id: str, status: str, reported_at: datetime, operation_id: str
) -> bool:
    return (
        await conn.fetchrow(
            "UPDATE nodes SET preflight_status = $2, preflight_reported_at = $3, preflight_operation_id = $4, "
            "updated_at = now() WHERE node_id = $1 AND (preflight_reported_at IS NULL OR preflight_reported_at <= $3) "
            "RETURNING node_id",
            node_id,
            status,
            reported_at,
            operation_id,
        )
        is not None
    )


class EvidenceRepository:
    """The evidence no `Host` method takes: a commissioning's preflight (its machine mapped to a node, the row kept
    for every report) and a node's image cache state (one row per image, not the node's)."""

    def __init__(self, conn: asyncpg.Connection) -> None:
        self.conn = conn

    async def node_for_machine(self, system_id: str, node_id: str | None) -> str | None:
        return await node_for_machine(self.conn, system_id, node_id)

    async def insert_slice_preflight(self, node_id: str | None, row: dict[str, Any]) -> bool:
        """False: a report of that operation is already kept."""
        return await insert_slice_preflight(self.conn, node_id, row)

    async def update_preflight(self, node_id: str, status: str, reported_at: datetime, operation_id: str) -> bool:
        """False: a newer report is applied already."""
        return await update_preflight(self.conn, node_id, status, reported_at, operation_id)

    async def upsert_image_readiness(
        self, node_id: str, slug: str, status: str, digest: str | None, schedulable: bool, reported_at: datetime
    ) -> bool:
        """False: a newer state of that image on that node is stored already."""
        return await upsert_image_readiness(self.conn, node_id, slug, status, digest, schedulable, reported_at)
