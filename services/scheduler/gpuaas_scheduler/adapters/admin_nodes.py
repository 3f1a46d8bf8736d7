"""The admin API's statements on nodes, their live claims, tenant quotas and the audit trail.

Callers that change a node hold its row lock (`lock_node`, inventory's locking protocol) first."""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from typing import Any

import asyncpg

NODE_VIEW = (
    "node_id, kind, hostname, region, pool, sku, maas_system_id, maas_tags, accepts_slices, accepts_baremetal, mode, "
    "mode_changed_at, mode_changed_by, mode_reason, evidence_reset_at, topology_reported_at, "
    "schedulable, parity_failures, parity_checked_at, parity_reported_at, parity_detail, preflight_status, "
    "preflight_reported_at, draining, drain_reason, drained_by, drained_at, "
    "maintenance, maintenance_reason, gpu_count, free_slots, total_slots, sliced, numa_free, updated_at"
)


def _json(value: Any) -> str | None:
    return json.dumps(value) if value is not None else None


async def audit(
    conn: asyncpg.Connection, actor: str, action: str, target: str, reason: str | None, detail: dict | None = None
) -> None:
    await conn.execute(
        "INSERT INTO admin_audit (actor, action, target, reason, detail) VALUES ($1, $2, $3, $4, $5::jsonb)",
        actor,
        action,
        target,
        reason,
        _json(detail),
    )


async def lock_node(conn: asyncpg.Connection, node_id: str) -> asyncpg.Record | None:
    return await conn.fetchrow("SELECT * FROM nodes WHERE node_id = $1 FOR UPDATE", node_id)


async def now(conn: asyncpg.Connection) -> datetime:
    """The transaction's clock."""
    return await conn.fetchval("SELECT now()")


async def lock_node_mode(conn: asyncpg.Connection, node_id: str) -> str | None:
    """The node's mode under its row lock; None for a node not registered yet."""
    return await conn.fetchval("SELECT mode FROM nodes WHERE node_id = $1 FOR UPDATE", node_id)


async def list_nodes(conn: asyncpg.Connection, region: str | None, sku: str | None) -> list[asyncpg.Record]:
    return await conn.fetch(
        f"SELECT {NODE_VIEW} FROM nodes WHERE ($1::text IS NULL OR region = $1) AND ($2::text IS NULL OR sku = $2) "
        "ORDER BY node_id",
        region,
        sku,
    )


async def node_view(conn: asyncpg.Connection, node_id: str) -> asyncpg.Record | None:
    return await conn.fetchrow(f"SELECT {NODE_VIEW} FROM nodes WHERE node_id = $1", node_id)


async def live_claims(conn: asyncpg.Connection, node_id: str) -> list[asyncpg.Record]:
    return await conn.fetch(
        "SELECT allocation_id, slot_id, claim_kind, status, tenant_id, gpus, fencing_epoch, created_at "
        "FROM allocation_resource_claims WHERE node_id = $1 AND status <> 'released' ORDER BY claim_id",
        node_id,
    )


async def upsert_node(
    conn: asyncpg.Connection,
    *,
    node_id: str,
    kind: str,
    hostname: str,
    region: str,
    pool: str,
    sku: str,
    maas_system_id: str | None,
    profile_intent: str,
    maas_tags: Sequence[str],
    mode: str,
    gpu_count: int,
) -> None:
    """Registers a node with its first mode, or updates what it declares; never its mode."""
    await conn.execute(
        "INSERT INTO nodes (node_id, kind, hostname, region, pool, sku, maas_system_id, profile_intent, maas_tags, "
        "mode, gpu_count) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11) "
        "ON CONFLICT (node_id) DO UPDATE SET hostname = EXCLUDED.hostname, region = EXCLUDED.region, "
        "pool = EXCLUDED.pool, sku = EXCLUDED.sku, maas_system_id = EXCLUDED.maas_system_id, "
        "profile_intent = EXCLUDED.profile_intent, maas_tags = EXCLUDED.maas_tags, "
        "gpu_count = EXCLUDED.gpu_count, updated_at = now()",
        node_id,
        kind,
        hostname,
        region,
        pool,
        sku,
        maas_system_id,
        profile_intent,
        list(maas_tags),
        mode,
        gpu_count,
    )


async def insert_waiver(
    conn: asyncpg.Connection, node_id: str, gate: str, actor: str, reason: str, expires_at: datetime
) -> asyncpg.Record:
    return await conn.fetchrow(
        "INSERT INTO node_waivers (node_id, gate, actor, reason, expires_at) VALUES ($1, $2, $3, $4, $5) "
        "RETURNING waiver_id, node_id, gate, actor, reason, expires_at, created_at",
        node_id,
        gate,
        actor,
        reason,
        expires_at,
    )


async def waivers(conn: asyncpg.Connection, node_id: str) -> list[asyncpg.Record]:
    """Every waiver of the node, newest first, with whether it is in force now (by the database's clock)."""
    return await conn.fetch(
        "SELECT waiver_id, node_id, gate, actor, reason, expires_at, created_at, expires_at > now() AS active "
        "FROM node_waivers WHERE node_id = $1 ORDER BY waiver_id DESC",
        node_id,
    )


async def drain(conn: asyncpg.Connection, node_id: str, *, reason: str, actor: str, maintenance: bool) -> None:
    await conn.execute(
        "UPDATE nodes SET draining = true, drain_reason = $2, drained_by = $3, drained_at = now(), "
        "maintenance = maintenance OR $4, maintenance_reason = CASE WHEN $4 THEN $2 ELSE maintenance_reason END, "
        "updated_at = now() WHERE node_id = $1",
        node_id,
        reason,
        actor,
        maintenance,
    )


async def undrain(conn: asyncpg.Connection, node_id: str) -> None:
    await conn.execute(
        "UPDATE nodes SET draining = false, drain_reason = NULL, drained_by = NULL, drained_at = NULL, "
        "maintenance = false, maintenance_reason = NULL, updated_at = now() WHERE node_id = $1",
        node_id,
    )


async def mode_record(conn: asyncpg.Connection, node_id: str) -> asyncpg.Record | None:
    """Who set the node's mode, when and why, and its last evidence reset."""
    return await conn.fetchrow(
        "SELECT mode_changed_at, mode_changed_by, mode_reason, evidence_reset_at FROM nodes WHERE node_id = $1", node_id
    )


async def upsert_quota(conn: asyncpg.Connection, tenant_id: str, max_gpus: int, *, actor: str, reason: str) -> None:
    await conn.execute(
        "INSERT INTO tenant_quotas (tenant_id, max_gpus, updated_by, reason) VALUES ($1, $2, $3, $4) "
        "ON CONFLICT (tenant_id) DO UPDATE SET max_gpus = EXCLUDED.max_gpus, updated_by = EXCLUDED.updated_by, "
        "reason = EXCLUDED.reason, updated_at = now()",
        tenant_id,
        max_gpus,
        actor,
        reason,
    )


async def quota(conn: asyncpg.Connection, tenant_id: str) -> asyncpg.Record | None:
    return await conn.fetchrow(
        "SELECT tenant_id, max_gpus, updated_by, reason, updated_at FROM tenant_quotas WHERE tenant_id = $1", tenant_id
    )


async def gpus_in_use(conn: asyncpg.Connection, tenant_id: str) -> int:
    return await conn.fetchval(
        "SELECT COALESCE(sum(gpus), 0) FROM allocation_resource_claims WHERE tenant_id = $1 AND status <> 'released'",
        tenant_id,
    )
