"""The asks sent to a host (node_actions) and the facts their rules read. Callers that insert hold the node's row
lock (inventory's locking protocol), so the facts cannot change between the rules and the write."""

from __future__ import annotations

import json
from typing import Any

import asyncpg

from ..domain.steering import OpenAsk, SteerFacts

_FACTS_SQL = (
    "SELECT n.node_id, n.kind, n.mode, n.maas_system_id, "
    " (n.mode = 'slice' AND NOT n.draining AND NOT n.maintenance) AS takes_placements, "
    " (SELECT count(*) FROM allocation_resource_claims c WHERE c.node_id = n.node_id AND c.status <> 'released') "
    "   AS live_claims, "
    " a.action_id, a.actor, a.requested_at, a.deadline "
    "FROM nodes n LEFT JOIN node_actions a "
    "  ON a.node_id = n.node_id AND a.kind = $2 AND a.status = 'requested' "
    "WHERE n.node_id = $1"
)

_COLUMNS = "action_id, node_id, kind, actor, reason, status, outcome, result, requested_at, deadline, finished_at"


async def facts(conn: asyncpg.Connection, node_id: str, kind: str) -> SteerFacts | None:
    row = await conn.fetchrow(_FACTS_SQL, node_id, kind)
    if row is None:
        return None
    ask = (
        OpenAsk(row["action_id"], row["actor"], row["requested_at"], row["deadline"])
        if row["action_id"] is not None
        else None
    )
    return SteerFacts(
        node_id=row["node_id"],
        node_kind=row["kind"],
        mode=row["mode"],
        maas_system_id=row["maas_system_id"],
        live_claims=row["live_claims"],
        takes_placements=row["takes_placements"],
        open_ask=ask,
    )


async def insert(
    conn: asyncpg.Connection, action_id: str, node_id: str, kind: str, actor: str, reason: str, deadline_s: float
) -> asyncpg.Record | None:
    """None when an ask of that kind is already open for the node (the unique index decides, across replicas)."""
    return await conn.fetchrow(
        "INSERT INTO node_actions (action_id, node_id, kind, actor, reason, deadline) "
        "VALUES ($1, $2, $3, $4, $5, now() + make_interval(secs => $6)) "
        f"ON CONFLICT (node_id, kind) WHERE status = 'requested' DO NOTHING RETURNING {_COLUMNS}",
        action_id,
        node_id,
        kind,
        actor,
        reason,
        deadline_s,
    )


async def record_part(
    conn: asyncpg.Connection,
    action_id: str,
    node_id: str,
    part: str,
    value: dict[str, Any],
    settle: tuple[str, str] | None,
) -> str | None:
    """Add one report's part to the ask's result; `settle` (status, outcome) closes it if still open. Only the
    node the ask went to can answer it. The ask's kind, or None when the id names no ask of that node."""
    return await conn.fetchval(
        "UPDATE node_actions SET result = result || jsonb_build_object($3::text, $4::jsonb), "
        " status = CASE WHEN $5::text IS NOT NULL AND status = 'requested' THEN $5 ELSE status END, "
        " outcome = CASE WHEN $5::text IS NOT NULL AND status = 'requested' THEN $6 ELSE outcome END, "
        " finished_at = CASE WHEN $5::text IS NOT NULL AND status = 'requested' THEN now() ELSE finished_at END "
        "WHERE action_id = $1 AND node_id = $2 RETURNING kind",
        action_id,
        node_id,
        part,
        json.dumps(value),
        settle[0] if settle else None,
        settle[1] if settle else None,
    )


async def kind_of(conn: asyncpg.Connection, action_id: str, node_id: str) -> str | None:
    return await conn.fetchval(
        "SELECT kind FROM node_actions WHERE action_id = $1 AND node_id = $2", action_id, node_id
    )


async def expire_overdue(conn: asyncpg.Connection, outcomes: dict[str, str]) -> list[asyncpg.Record]:
    """Close the asks whose deadline passed unanswered, each with its kind's outcome."""
    return await conn.fetch(
        "UPDATE node_actions a SET status = 'expired', finished_at = now(), outcome = o.outcome "
        "FROM jsonb_each_text($1::jsonb) AS o(kind, outcome) "
        "WHERE a.kind = o.kind AND a.status = 'requested' AND a.deadline < now() "
        "RETURNING a.action_id, a.node_id, a.kind",
        json.dumps(outcomes),
    )


async def due_for_parity(
    conn: asyncpg.Connection, modes: tuple[str, ...], interval_s: float | None, limit: int
) -> list[str]:
    """Slice hosts owed a parity run: none is open, and their mode changed since the last one was asked, or (with
    an interval) neither a report nor an ask is that recent. Locked, skipping nodes another replica holds."""
    return [
        r["node_id"]
        for r in await conn.fetch(
            "SELECT n.node_id FROM nodes n "
            "LEFT JOIN LATERAL (SELECT max(a.requested_at) AS at, bool_or(a.status = 'requested') AS open "
            "  FROM node_actions a WHERE a.node_id = n.node_id AND a.kind IN ('parity', 'rediscover')) last ON true "
            "WHERE n.kind = 'slice_host' AND n.mode = ANY($1::text[]) AND NOT COALESCE(last.open, false) "
            "AND (n.mode_changed_at > COALESCE(last.at, '-infinity') "
            "  OR ($2::float8 IS NOT NULL AND GREATEST(COALESCE(n.parity_reported_at, '-infinity'), "
            "       COALESCE(last.at, '-infinity')) < now() - make_interval(secs => $2))) "
            "ORDER BY n.node_id LIMIT $3 FOR UPDATE OF n SKIP LOCKED",
            list(modes),
            interval_s,
            limit,
        )
    ]


async def history(conn: asyncpg.Connection, node_id: str, limit: int = 20) -> list[asyncpg.Record]:
    return await conn.fetch(
        f"SELECT {_COLUMNS} FROM node_actions WHERE node_id = $1 ORDER BY requested_at DESC, action_id LIMIT $2",
        node_id,
        limit,
    )


async def get(conn: asyncpg.Connection, action_id: str) -> asyncpg.Record | None:
    return await conn.fetchrow(f"SELECT {_COLUMNS} FROM node_actions WHERE action_id = $1", action_id)


class NodeActionRepository:
    """The asks sent to hosts (node_actions) and the facts their rules read; rows as dicts."""

    def __init__(self, conn: asyncpg.Connection) -> None:
        self.conn = conn

    async def facts(self, node_id: str, kind: str) -> SteerFacts | None:
        return await facts(self.conn, node_id, kind)

    async def insert(
        self, action_id: str, node_id: str, kind: str, actor: str, reason: str, deadline_s: float
    ) -> dict[str, Any] | None:
        row = await insert(self.conn, action_id, node_id, kind, actor, reason, deadline_s)
        return dict(row) if row is not None else None

    async def kind_of(self, action_id: str, node_id: str) -> str | None:
        return await kind_of(self.conn, action_id, node_id)

    async def record_part(
        self, action_id: str, node_id: str, part: str, value: dict[str, Any], settle: tuple[str, str] | None
    ) -> str | None:
        return await record_part(self.conn, action_id, node_id, part, value, settle)

    async def get(self, action_id: str) -> dict[str, Any] | None:
        row = await get(self.conn, action_id)
        return dict(row) if row is not None else None

    async def expire_overdue(self, outcomes: dict[str, str]) -> list[dict[str, Any]]:
        return [dict(r) for r in await expire_overdue(self.conn, outcomes)]

    async def due_for_parity(self, modes: tuple[str, ...], interval_s: float | None, limit: int) -> list[str]:
        return await due_for_parity(self.conn, modes, interval_s, limit)
