"""Host walks in Postgres (domain/host_walk.py): the walk's row, its steps, and what starting one reads. A walk is
loaded locked, so two messages about one walk handled by two replicas apply one after the other."""

from __future__ import annotations

import json
from typing import Any

import asyncpg

from ..domain.host_walk import OPEN, ApprovedSlot, HostWalk, WalkState
from . import admin_slots

_COLUMNS = (
    "walk_id, node_id, state, reason, profile, operation_id, rediscover_action_id, slots, parity_passed_early, "
    "started_at, updated_at"
)


def _walk(row: asyncpg.Record) -> HostWalk:
    slots = row["slots"]
    slots = json.loads(slots) if isinstance(slots, str) else slots
    return HostWalk(
        WalkState(
            walk_id=str(row["walk_id"]),
            node_id=row["node_id"],
            state=row["state"],
            reason=row["reason"],
            slots=tuple(ApprovedSlot(s["slot_id"], s.get("gpu_pci_address"), s.get("profile")) for s in slots),
            profile=row["profile"],
            rediscover_action_id=row["rediscover_action_id"],
            parity_passed_early=row["parity_passed_early"],
        )
    )


async def by_operation(conn: asyncpg.Connection, operation_id: str) -> HostWalk | None:
    row = await conn.fetchrow(f"SELECT {_COLUMNS} FROM host_walks WHERE operation_id = $1 FOR UPDATE", operation_id)
    return _walk(row) if row else None


async def by_rediscovery(conn: asyncpg.Connection, node_id: str, action_id: str) -> HostWalk | None:
    row = await conn.fetchrow(
        f"SELECT {_COLUMNS} FROM host_walks WHERE node_id = $1 AND rediscover_action_id = $2 FOR UPDATE",
        node_id,
        action_id,
    )
    return _walk(row) if row else None


async def save(conn: asyncpg.Connection, walk: HostWalk, operation_id: str | None = None) -> None:
    """The walk's state and the steps it recorded (then forgotten); inserted the first time."""
    s = walk.state_
    slots = json.dumps(
        [{"slot_id": x.slot_id, "gpu_pci_address": x.gpu_pci_address, "profile": x.profile} for x in s.slots]
    )
    if walk.new:
        await conn.execute(
            "INSERT INTO host_walks (walk_id, node_id, state, reason, profile, operation_id, rediscover_action_id, "
            "slots, parity_passed_early) VALUES ($1::uuid, $2, $3, $4, $5, $6, $7, $8::jsonb, $9)",
            s.walk_id,
            s.node_id,
            s.state,
            s.reason,
            s.profile,
            operation_id,
            s.rediscover_action_id,
            slots,
            s.parity_passed_early,
        )
        walk.new = False
    else:
        await conn.execute(
            "UPDATE host_walks SET state = $2, reason = $3, rediscover_action_id = $4, parity_passed_early = $5, "
            "operation_id = COALESCE(operation_id, $6), updated_at = now() WHERE walk_id = $1::uuid",
            s.walk_id,
            s.state,
            s.reason,
            s.rediscover_action_id,
            s.parity_passed_early,
            operation_id,
        )
    if walk.steps:
        await conn.executemany(
            "INSERT INTO host_walk_steps (walk_id, node_id, from_state, to_state, reason, at) "
            "VALUES ($1::uuid, $2, $3, $4, $5, $6)",
            [(st.walk_id, st.node_id, st.from_state, st.to_state, st.reason, st.at) for st in walk.steps],
        )
        walk.steps.clear()


async def owed_a_walk(conn: asyncpg.Connection, limit: int) -> list[asyncpg.Record]:
    """Converting slice hosts that entered converting after their last walk started (or never walked), locked,
    skipping nodes another replica holds."""
    return await conn.fetch(
        "SELECT n.node_id, n.mode, n.maas_system_id FROM nodes n "
        "WHERE n.kind = 'slice_host' AND n.mode = 'converting' "
        "AND NOT EXISTS (SELECT 1 FROM host_walks w WHERE w.node_id = n.node_id "
        "  AND (w.started_at >= n.mode_changed_at OR w.state = ANY($2::text[]))) "
        "ORDER BY n.node_id LIMIT $1 FOR UPDATE OF n SKIP LOCKED",
        limit,
        list(OPEN),
    )


async def open_walks_off_course(conn: asyncpg.Connection, limit: int) -> list[asyncpg.Record]:
    """Open walks whose host is no longer converting (moved by hand), with the mode and who moved it; locked."""
    return await conn.fetch(
        f"SELECT {', '.join('w.' + c.strip() for c in _COLUMNS.split(','))}, n.mode, n.mode_changed_by "
        "FROM host_walks w JOIN nodes n USING (node_id) "
        "WHERE w.state = ANY($1::text[]) AND n.mode <> 'converting' "
        "ORDER BY w.node_id LIMIT $2 FOR UPDATE OF w, n SKIP LOCKED",
        list(OPEN),
        limit,
    )


def walk_of(row: asyncpg.Record) -> HostWalk:
    return _walk(row)


async def slots_left_behind(conn: asyncpg.Connection, node_id: str) -> list[ApprovedSlot]:
    """The slots the host had approved when it last left slice mode: retired since then (a host leaves slice
    mode for baremetal, converting or retired only with every slot retired), not before."""
    rows = await conn.fetch(
        "SELECT s.slot_id, s.gpu_pci_address, s.profile FROM node_resource_slots s "
        "WHERE s.node_id = $1 AND s.status = 'retired' AND s.approved_at IS NOT NULL "
        "AND EXISTS (SELECT 1 FROM slot_transitions t WHERE t.slot_id = s.slot_id AND t.to_status = 'retired' "
        "  AND t.at >= (SELECT max(h.at) FROM node_mode_history h WHERE h.node_id = $1 AND h.from_mode = 'slice')) "
        "ORDER BY s.slot_id",
        node_id,
    )
    return [ApprovedSlot(r["slot_id"], r["gpu_pci_address"], r["profile"]) for r in rows]


async def history(conn: asyncpg.Connection, node_id: str, limit: int = 20) -> list[dict[str, Any]]:
    """The node's latest walks, newest first, each with its steps in order."""
    walks = await conn.fetch(
        f"SELECT {_COLUMNS} FROM host_walks WHERE node_id = $1 ORDER BY started_at DESC LIMIT $2", node_id, limit
    )
    steps = await conn.fetch(
        "SELECT walk_id, from_state, to_state, reason, at FROM host_walk_steps "
        "WHERE walk_id = ANY($1::uuid[]) ORDER BY id",
        [w["walk_id"] for w in walks],
    )
    out = []
    for w in walks:
        d = {k: w[k] for k in ("walk_id", "state", "reason", "profile", "operation_id", "started_at", "updated_at")}
        d["walk_id"] = str(w["walk_id"])
        d["rediscover_action_id"] = w["rediscover_action_id"]
        slots = w["slots"]
        d["slots"] = [s["slot_id"] for s in (json.loads(slots) if isinstance(slots, str) else slots)]
        d["steps"] = [
            {k: st[k] for k in ("from_state", "to_state", "reason", "at")}
            for st in steps
            if st["walk_id"] == w["walk_id"]
        ]
        out.append(d)
    return out


class WalkRepository:
    """The host walks, what starting or stopping one reads, and the savepoint a walk's re-approval runs under (the
    unit of work began its transaction by hand): a refused approval leaves no slot of the walk half-approved,
    while the walk's stop still commits."""

    _SAVEPOINT = "host_walk_reapproval"

    def __init__(self, conn: asyncpg.Connection) -> None:
        self.conn = conn

    async def by_operation(self, operation_id: str) -> HostWalk | None:
        return await by_operation(self.conn, operation_id)

    async def by_rediscovery(self, node_id: str, action_id: str) -> HostWalk | None:
        return await by_rediscovery(self.conn, node_id, action_id)

    async def save(self, walk: HostWalk, operation_id: str | None = None) -> None:
        await save(self.conn, walk, operation_id)

    async def owed_a_walk(self, limit: int) -> list[dict[str, Any]]:
        return [dict(r) for r in await owed_a_walk(self.conn, limit)]

    async def off_course(self, limit: int) -> list[tuple[HostWalk, str, str | None]]:
        """Open walks whose host left converting: each walk, the host's mode and who moved it."""
        return [(_walk(r), r["mode"], r["mode_changed_by"]) for r in await open_walks_off_course(self.conn, limit)]

    async def slots_left_behind(self, node_id: str) -> list[ApprovedSlot]:
        return await slots_left_behind(self.conn, node_id)

    async def candidates(self, node_id: str) -> list[dict[str, Any]]:
        return [dict(c) for c in await admin_slots.list_candidates(self.conn, node_id)]

    async def begin_reapproval(self) -> None:
        await self.conn.execute(f"SAVEPOINT {self._SAVEPOINT}")

    async def undo_reapproval(self) -> None:
        await self.conn.execute(f"ROLLBACK TO SAVEPOINT {self._SAVEPOINT}")

    async def keep_reapproval(self) -> None:
        await self.conn.execute(f"RELEASE SAVEPOINT {self._SAVEPOINT}")
