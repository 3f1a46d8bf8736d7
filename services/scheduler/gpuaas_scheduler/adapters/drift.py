"""Statements on host drift (see domain/drift.py for the rules and migration 010 for the tables)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from typing import Any

import asyncpg

from ..domain.drift import SLOT_DEVICE_FIELDS, DriftKey, Item
from ..domain.host import DriftRecorded
from . import inventory as inv

DRIFT_VIEW = (
    "drift_id, node_id, slot_id, kind, subject, detail, devices, status, first_reported_at, last_reported_at, "
    "acknowledged_at, acknowledged_by, ack_reason, resolved_at, resolved_by"
)


async def take_report(conn: asyncpg.Connection, node_id: str, checked_at: datetime) -> bool:
    """Mark the report applied when it is newer than the last applied and than the host's evidence reset
    (the node row stays locked for the rest of the transaction)."""
    return (
        await conn.fetchrow(
            "UPDATE nodes SET drift_reported_at = $2, updated_at = now() "
            "WHERE node_id = $1 AND (drift_reported_at IS NULL OR drift_reported_at < $2) "
            "AND (evidence_reset_at IS NULL OR evidence_reset_at < $2) RETURNING node_id",
            node_id,
            checked_at,
        )
        is not None
    )


async def insert_report(
    conn: asyncpg.Connection, event_id: str, node_id: str, checked_at: datetime, drift: list[dict[str, Any]]
) -> None:
    await conn.execute(
        "INSERT INTO node_drift_reports (event_id, node_id, checked_at, drift) VALUES ($1, $2, $3, $4::jsonb) "
        "ON CONFLICT (event_id) DO NOTHING",
        event_id,
        node_id,
        checked_at,
        json.dumps(drift),
    )


async def trim_reports(conn: asyncpg.Connection, node_id: str, keep: int) -> int:
    """Delete the node's reports beyond its `keep` newest (through node_drift_reports_node); how many went."""
    status = await conn.execute(
        "DELETE FROM node_drift_reports WHERE event_id IN (SELECT event_id FROM node_drift_reports "
        "WHERE node_id = $1 ORDER BY checked_at DESC, event_id DESC OFFSET $2)",
        node_id,
        keep,
    )
    return int(status.split()[-1])


async def node_slots(conn: asyncpg.Connection, node_id: str) -> list[dict[str, Any]]:
    rows = await conn.fetch(
        f"SELECT slot_id, {', '.join(SLOT_DEVICE_FIELDS)} FROM node_resource_slots WHERE node_id = $1 ORDER BY slot_id",
        node_id,
    )
    return [dict(r) for r in rows]


async def held_keys(conn: asyncpg.Connection, node_id: str) -> list[DriftKey]:
    rows = await conn.fetch(
        "SELECT kind, subject, slot_id FROM node_drift WHERE node_id = $1 AND status <> 'resolved'", node_id
    )
    return [(r["kind"], r["subject"], r["slot_id"]) for r in rows]


async def open_items(conn: asyncpg.Connection, node_id: str, items: dict[DriftKey, Item], at: datetime) -> None:
    await conn.executemany(
        "INSERT INTO node_drift (node_id, slot_id, kind, subject, detail, devices, status, first_reported_at, "
        "last_reported_at) VALUES ($1, $2, $3, $4, $5, $6::jsonb, 'open', $7, $7)",
        [
            (node_id, slot, kind, subject, item.detail, json.dumps(list(item.devices)), at)
            for (kind, subject, slot), item in items.items()
        ],
    )


async def touch_items(conn: asyncpg.Connection, node_id: str, items: dict[DriftKey, Item], at: datetime) -> None:
    await conn.executemany(
        "UPDATE node_drift SET detail = $5, devices = $6::jsonb, last_reported_at = $7 "
        "WHERE node_id = $1 AND kind = $2 AND subject = $3 AND slot_id IS NOT DISTINCT FROM $4 "
        "AND status <> 'resolved'",
        [
            (node_id, kind, subject, slot, item.detail, json.dumps(list(item.devices)), at)
            for (kind, subject, slot), item in items.items()
        ],
    )


async def resolve_items(
    conn: asyncpg.Connection, node_id: str, keys: Sequence[DriftKey], at: datetime, by: str
) -> None:
    await conn.executemany(
        "UPDATE node_drift SET status = 'resolved', resolved_at = $5, resolved_by = $6 "
        "WHERE node_id = $1 AND kind = $2 AND subject = $3 AND slot_id IS NOT DISTINCT FROM $4 "
        "AND status <> 'resolved'",
        [(node_id, kind, subject, slot, at, by) for kind, subject, slot in keys],
    )


async def acknowledge(
    conn: asyncpg.Connection, node_id: str, drift_ids: list[int] | None, actor: str, reason: str
) -> list[asyncpg.Record]:
    """Open drift of the node (all of it, or the ids named) -> acknowledged; the rows changed."""
    return await conn.fetch(
        f"UPDATE node_drift SET status = 'acknowledged', acknowledged_at = now(), acknowledged_by = $3, "
        f"ack_reason = $4 WHERE node_id = $1 AND status = 'open' "
        f"AND ($2::bigint[] IS NULL OR drift_id = ANY($2::bigint[])) RETURNING {DRIFT_VIEW}",
        node_id,
        drift_ids,
        actor,
        reason,
    )


async def refresh_node_flag(conn: asyncpg.Connection, node_id: str) -> None:
    await conn.execute(
        "UPDATE nodes SET drift_open = EXISTS (SELECT 1 FROM node_drift d WHERE d.node_id = $1 "
        "AND d.slot_id IS NULL AND d.status = 'open') WHERE node_id = $1",
        node_id,
    )


async def list_drift(conn: asyncpg.Connection, node_id: str, include_resolved: bool) -> list[asyncpg.Record]:
    return await conn.fetch(
        f"SELECT {DRIFT_VIEW} FROM node_drift WHERE node_id = $1 AND ($2 OR status <> 'resolved') "
        "ORDER BY status = 'resolved', first_reported_at, drift_id",
        node_id,
        include_resolved,
    )


async def drift_by_id(conn: asyncpg.Connection, node_id: str, drift_ids: list[int]) -> list[asyncpg.Record]:
    return await conn.fetch(
        f"SELECT {DRIFT_VIEW} FROM node_drift WHERE node_id = $1 AND drift_id = ANY($2::bigint[])",
        node_id,
        drift_ids,
    )


async def record(conn: asyncpg.Connection, ch: DriftRecorded) -> None:
    """A report the `Host` took: marked applied on the node, kept as it came (the node's `keep` newest), its items
    opened, kept or resolved, and the node's flag and capacity summary recomputed."""
    await take_report(conn, ch.node_id, ch.checked_at)
    await insert_report(conn, ch.event_id, ch.node_id, ch.checked_at, list(ch.report))
    await trim_reports(conn, ch.node_id, ch.keep)
    await resolve_items(conn, ch.node_id, ch.change.resolve, ch.checked_at, "node-agent report")
    await touch_items(conn, ch.node_id, ch.change.still, ch.checked_at)
    await open_items(conn, ch.node_id, ch.change.open, ch.checked_at)
    await refresh_node_flag(conn, ch.node_id)
    await inv.refresh_nodes(conn, [ch.node_id])


class DriftRepository:
    """What a drift report is judged against: the host's slots with their devices and its unresolved items."""

    def __init__(self, conn: asyncpg.Connection) -> None:
        self.conn = conn

    async def node_slots(self, node_id: str) -> list[dict[str, Any]]:
        return await node_slots(self.conn, node_id)

    async def held_keys(self, node_id: str) -> list[DriftKey]:
        return await held_keys(self.conn, node_id)


async def node_flags(conn: asyncpg.Connection, node_id: str) -> asyncpg.Record | None:
    return await conn.fetchrow("SELECT drift_open, drift_reported_at FROM nodes WHERE node_id = $1", node_id)
