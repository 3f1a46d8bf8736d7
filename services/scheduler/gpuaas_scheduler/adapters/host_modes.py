"""Host modes in Postgres: the facts the transition guards read, and the changes a `Host` recorded,
persisted with their history. Callers hold the node's row lock (inventory's locking protocol), so
the facts cannot change between the guard and the write.
"""

from __future__ import annotations

import json
from datetime import datetime

import asyncpg

from ..domain.host_mode import Host, HostFacts, ModeChange

_FACTS_SQL = (
    "SELECT n.node_id, n.mode, n.accepts_slices, n.accepts_baremetal, n.parity_failures, "
    # The reset clears topology_reported_at and stale reports are refused, so any value is a rediscovery.
    " n.topology_reported_at IS NOT NULL AS rediscovered, "
    " (SELECT count(*) FROM allocation_resource_claims c WHERE c.node_id = n.node_id AND c.status <> 'released')"
    "   AS live_claims, "
    " (SELECT count(*) FROM node_resource_slots s WHERE s.node_id = n.node_id AND s.status <> 'retired')"
    "   AS unretired_slots, "
    # awaiting_wipe counts as re-approved: the host may enter slice mode (and bind its devices) while its slots,
    # placed nowhere meanwhile, wait for its own wipe proof (domain/slot_wipe.py).
    " (SELECT count(*) FROM node_resource_slots s WHERE s.node_id = n.node_id "
    "   AND s.status IN ('available', 'awaiting_wipe') "
    "   AND s.approved_at >= COALESCE(n.evidence_reset_at, '-infinity')) AS reapproved_slots, "
    " (SELECT count(*) FROM node_resource_slots s WHERE s.node_id = n.node_id AND s.status <> 'retired' "
    "   AND n.evidence_reset_at IS NOT NULL AND (s.approved_at IS NULL OR s.approved_at < n.evidence_reset_at))"
    "   AS stale_slots, "
    # The database's clock, the one approved_at and evidence_reset_at are compared on.
    " now() AS now "
    "FROM nodes n WHERE n.node_id = $1"
)


async def load_host(conn: asyncpg.Connection, node_id: str) -> tuple[Host, datetime] | None:
    """The node's aggregate and the transaction's time, or None for an unknown node."""
    row = await conn.fetchrow(_FACTS_SQL, node_id)
    if row is None:
        return None
    facts = HostFacts(
        node_id=row["node_id"],
        mode=row["mode"],
        accepts_slices=row["accepts_slices"],
        accepts_baremetal=row["accepts_baremetal"],
        live_claims=row["live_claims"],
        unretired_slots=row["unretired_slots"],
        parity_failures=row["parity_failures"],
        rediscovered=row["rediscovered"],
        reapproved_slots=row["reapproved_slots"],
        stale_slots=row["stale_slots"],
    )
    return Host(facts), row["now"]


async def save(conn: asyncpg.Connection, host: Host) -> list[ModeChange]:
    """Persist the changes the aggregate recorded (mode, who/why/when, history) and forget them."""
    saved = list(host.changes)
    for ch in saved:
        await write_change(conn, ch)
    host.changes.clear()
    return saved


async def write_change(conn: asyncpg.Connection, ch: ModeChange) -> None:
    """One mode change: the node's mode with who/why/when, its evidence reset where it calls for one, a history
    row."""
    await conn.execute(
        "UPDATE nodes SET mode = $2, mode_changed_at = $3, mode_changed_by = $4, mode_reason = $5, "
        "updated_at = now() WHERE node_id = $1",
        ch.node_id,
        ch.to_mode,
        ch.at,
        ch.actor,
        ch.reason,
    )
    if ch.resets_evidence:
        await reset_evidence(conn, ch.node_id, ch.at)
    await conn.execute(
        "INSERT INTO node_mode_history (node_id, from_mode, to_mode, actor, reason, allocation_id, detail, at) "
        "VALUES ($1, $2, $3, $4, $5, $6::uuid, $7::jsonb, $8)",
        ch.node_id,
        ch.from_mode,
        ch.to_mode,
        ch.actor,
        ch.reason,
        ch.allocation_id,
        json.dumps({"evidence_reset": ch.resets_evidence}),
        ch.at,
    )


async def reset_evidence(conn: asyncpg.Connection, node_id: str, at: datetime) -> None:
    """Parity and topology (hugepage capacity included) back to unknown. Candidates go too, approved ones
    included: they carry the disk evidence of the host as it was, and rediscovery must be free to replace them."""
    await conn.execute(
        "UPDATE nodes SET parity_failures = NULL, parity_detail = NULL, parity_checked_at = NULL, "
        "parity_reported_at = NULL, topology_reported_at = NULL, topology_blockers = NULL, hugepages_1g_total = NULL, "
        "hugepages_1g_free = NULL, evidence_reset_at = $2 "
        "WHERE node_id = $1",
        node_id,
        at,
    )
    await conn.execute("DELETE FROM candidate_slots WHERE node_id = $1", node_id)


async def record_created(conn: asyncpg.Connection, node_ids: list[str], actor: str, reason: str) -> None:
    """The first history row of newly registered nodes: their mode as registered."""
    if node_ids:
        await conn.execute(
            "WITH n AS (UPDATE nodes SET mode_changed_at = now(), mode_changed_by = $2, mode_reason = $3 "
            "  WHERE node_id = ANY($1::text[]) RETURNING node_id, mode) "
            "INSERT INTO node_mode_history (node_id, from_mode, to_mode, actor, reason) "
            "SELECT node_id, NULL, mode, $2, $3 FROM n",
            node_ids,
            actor,
            reason,
        )


async def history(conn: asyncpg.Connection, node_id: str, limit: int = 20) -> list[asyncpg.Record]:
    return await conn.fetch(
        "SELECT from_mode, to_mode, actor, reason, allocation_id, detail, at FROM node_mode_history "
        "WHERE node_id = $1 ORDER BY id DESC LIMIT $2",
        node_id,
        limit,
    )


class HostModeRepository:
    def __init__(self, conn: asyncpg.Connection) -> None:
        self.conn = conn

    async def load(self, node_id: str) -> tuple[Host, datetime] | None:
        return await load_host(self.conn, node_id)

    async def save(self, host: Host) -> list[ModeChange]:
        return await save(self.conn, host)
