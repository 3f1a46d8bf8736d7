"""Every statement that writes the read models. Writes are merges (upserts with LEAST/GREATEST/COALESCE), so a
row is the same whichever stream was read first."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import asyncpg
from pydantic import BaseModel

from gpuaas_common.outbox import EventCollector, PendingEvent, pending_statement, write_pending

from ..domain.models import TASK_FINAL, task_status
from ..domain.usage import Move, Usage
from .host_rows import DEAD_LETTERS, NODE_TASK_PHASES, NODE_TASKS, Capped, trim

# The models' own schema: its outbox carries the events ops-view publishes (usage.recorded), relayed by the
# service's outbox relay like every other service's.
SCHEMA = "ops_view"
PRODUCER = "ops-view"
# Postgres NOTIFY channel naming each stream whose rows a commit changed.
CHANGED_CHANNEL = "ops_view_changed"

# domain.models.task_status again, in the statement that writes the row: the task's messages and its reports
# are followed on different streams at once, and a row both see for the first time is written by both; the
# merge must hold between the two writes, not only between a read and a write.
_FINAL = ", ".join(f"'{s}'" for s in TASK_FINAL)
_MERGED_STATUS = (
    f"CASE WHEN t.status IN ({_FINAL}) THEN t.status WHEN EXCLUDED.status IN ({_FINAL}) THEN EXCLUDED.status "
    "WHEN EXCLUDED.status <> 'queued' THEN 'running' ELSE t.status END"
)


def _j(value: Any) -> str | None:
    return None if value is None else json.dumps(value, default=str)


# --- allocation and node task statements, shared by the message-at-a-time and the batch repositories ------

_ADD_TRANSITION = (
    "INSERT INTO allocation_timeline (allocation_id, seq, state, previous_state, event_id, at, detail) "
    "VALUES ($1, $2, $3, $4, $5, $6, $7::jsonb) ON CONFLICT DO NOTHING"
)

_ALLOCATION_COLUMNS = (
    "allocation_id",
    "tenant_id",
    "shape",
    "state",
    "seq",
    "sku",
    "gpu_count",
    "region",
    "image",
    "node_id",
    "claim_mode",
    "reason_code",
    "reason",
    "access",
    "why_not",
    "created_at",
    "updated_at",
)
_ALLOCATION_JSON = ("access", "why_not")
_ALLOCATION_FILLED = ("sku", "gpu_count", "region", "image", "node_id", "claim_mode", "access", "why_not")
# The last parameter says whether the event is the allocation's newest transition: then its state, seq and
# reason replace the row's; an older one (read after a newer) only fills what is still unknown. A parameter, not
# two statements, so a batch's rows go in one executemany in stream order.
_NEWEST = f"${len(_ALLOCATION_COLUMNS) + 1}::boolean"
_UPSERT_ALLOCATION = (
    f"INSERT INTO allocations AS a ({', '.join(_ALLOCATION_COLUMNS)}) VALUES ("
    + ", ".join(f"${i + 1}{'::jsonb' if c in _ALLOCATION_JSON else ''}" for i, c in enumerate(_ALLOCATION_COLUMNS))
    + ") ON CONFLICT (allocation_id) DO UPDATE SET "
    + "".join(f"{c} = CASE WHEN {_NEWEST} THEN EXCLUDED.{c} ELSE a.{c} END, " for c in ("state", "seq", "updated_at"))
    + "".join(
        f"{c} = CASE WHEN {_NEWEST} THEN EXCLUDED.{c} ELSE COALESCE(a.{c}, EXCLUDED.{c}) END, "
        for c in ("reason_code", "reason")
    )
    + "".join(f"{c} = COALESCE(a.{c}, EXCLUDED.{c}), " for c in _ALLOCATION_FILLED)
    + "tenant_id = CASE WHEN a.tenant_id = '' THEN EXCLUDED.tenant_id ELSE a.tenant_id END, "
    "created_at = LEAST(a.created_at, EXCLUDED.created_at)"
)
# What a usage record takes from the allocation's row.
_FACTS = ("tenant_id", "shape", "sku", "gpu_count", "region", "node_id")

_PLACE_CLAIM = (
    "INSERT INTO claims (allocation_id, node_id, slot_id, claim_mode, placed_at) VALUES ($1, $2, $3, $4, $5) "
    "ON CONFLICT DO NOTHING"
)
_SEE_SLOT = (
    "INSERT INTO slots (node_id, slot_id, profile, gpu_pci, nvme_by_id, private_ip, first_seen) "
    "VALUES ($1, $2, $3, $4, $5, $6, $7) ON CONFLICT (node_id, slot_id) DO UPDATE SET "
    "first_seen = LEAST(slots.first_seen, EXCLUDED.first_seen)"
)
_END_CLAIMS = "UPDATE claims SET released_at = $2, outcome = $3 WHERE allocation_id = $1 AND released_at IS NULL"

# A host's slots as the scheduler announced them (scheduler.slots_changed). The announcement replaces what the row
# holds of the slot, its binding included (so a placement's _SEE_SLOT, which only fills a row it creates, leaves
# the same row whichever of the two is read first), and only when it is newer than the one the row took.
_ANNOUNCED_SLOT_COLUMNS = (
    "node_id",
    "slot_id",
    "profile",
    "gpu_pci",
    "nvme_by_id",
    "private_ip",
    "first_seen",
    "announced_status",
    "status_reason",
    "health_state",
    "health_detail",
    "generation",
    "announced_at",
)
_ANNOUNCE_SLOT = (
    f"INSERT INTO slots AS s ({', '.join(_ANNOUNCED_SLOT_COLUMNS)}) VALUES "
    f"({', '.join(f'${i + 1}' for i in range(len(_ANNOUNCED_SLOT_COLUMNS)))}) "
    "ON CONFLICT (node_id, slot_id) DO UPDATE SET "
    + "".join(f"{c} = EXCLUDED.{c}, " for c in _ANNOUNCED_SLOT_COLUMNS[2:] if c != "first_seen")
    + "first_seen = LEAST(s.first_seen, EXCLUDED.first_seen) "
    "WHERE s.generation IS NULL OR s.generation < EXCLUDED.generation"
)
_ANNOUNCE_HOST = (
    "INSERT INTO hosts AS h (node_id, updated_at, slots_generation, slots_event_id, slots_changed_at) "
    "VALUES ($1, $4, $2, $3, $4) ON CONFLICT (node_id) DO UPDATE SET slots_generation = EXCLUDED.slots_generation, "
    "slots_event_id = EXCLUDED.slots_event_id, slots_changed_at = EXCLUDED.slots_changed_at, "
    "updated_at = GREATEST(h.updated_at, EXCLUDED.updated_at)"
)

_MOVE_COLUMNS = "allocation_id, seq, state, at, event_id, detail->>'reason_code' AS reason_code"
# What a batch's allocations need, in one round trip and locked as the one-by-one reads lock it: a row per
# allocation and move of its timeline (one with no move when it has none), with its row's facts and whether its
# usage record is closed.
_LOAD_ALLOCATIONS = f"""
WITH moves AS (
    SELECT {_MOVE_COLUMNS} FROM allocation_timeline WHERE allocation_id = ANY($1::uuid[]) FOR UPDATE
), usage AS (
    SELECT allocation_id, stopped_at IS NOT NULL AS usage_closed FROM usage_records
    WHERE allocation_id = ANY($1::uuid[]) FOR UPDATE
)
SELECT ids.allocation_id, m.seq, m.state, m.at, m.event_id, m.reason_code, a.allocation_id IS NOT NULL AS has_row,
    {", ".join(f"a.{c}" for c in _FACTS)}, u.usage_closed
FROM unnest($1::uuid[]) AS ids (allocation_id)
LEFT JOIN moves m USING (allocation_id)
LEFT JOIN allocations a USING (allocation_id)
LEFT JOIN usage u USING (allocation_id)
"""
_PUT_USAGE = (
    "INSERT INTO usage_records AS u (allocation_id, tenant_id, shape, sku, gpu_count, region, node_id, "
    "started_at, stopped_at, ended, end_reason_code, start_event_id, stop_event_id) "
    "VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13) ON CONFLICT (allocation_id) DO UPDATE SET "
    "tenant_id = EXCLUDED.tenant_id, shape = EXCLUDED.shape, sku = COALESCE(EXCLUDED.sku, u.sku), "
    "gpu_count = COALESCE(EXCLUDED.gpu_count, u.gpu_count), region = COALESCE(EXCLUDED.region, u.region), "
    "node_id = COALESCE(EXCLUDED.node_id, u.node_id), started_at = EXCLUDED.started_at, "
    "stopped_at = EXCLUDED.stopped_at, ended = EXCLUDED.ended, end_reason_code = EXCLUDED.end_reason_code, "
    "start_event_id = EXCLUDED.start_event_id, stop_event_id = EXCLUDED.stop_event_id"
)

_TASK_COLUMNS = (
    "task_id",
    "allocation_id",
    "node_id",
    "task_type",
    "sent_at",
    "deadline",
    "status",
    "reason_code",
    "reason",
    "finished_at",
    "updated_at",
)
_UPSERT_TASK = (
    f"INSERT INTO node_tasks AS t ({', '.join(_TASK_COLUMNS)}) VALUES "
    f"({', '.join(f'${i + 1}' for i in range(len(_TASK_COLUMNS)))}) "
    "ON CONFLICT (task_id) DO UPDATE SET allocation_id = COALESCE(t.allocation_id, EXCLUDED.allocation_id), "
    "task_type = COALESCE(t.task_type, EXCLUDED.task_type), sent_at = COALESCE(t.sent_at, EXCLUDED.sent_at), "
    f"deadline = COALESCE(t.deadline, EXCLUDED.deadline), status = {_MERGED_STATUS}, "
    "reason_code = COALESCE(t.reason_code, EXCLUDED.reason_code), "
    "reason = COALESCE(t.reason, EXCLUDED.reason), "
    "finished_at = COALESCE(t.finished_at, EXCLUDED.finished_at), "
    "updated_at = GREATEST(t.updated_at, EXCLUDED.updated_at) "
    # A task is its node's: a report from another host naming its id (a host may publish only its own reports,
    # never another's task) changes nothing of it.
    "WHERE t.node_id IS NOT DISTINCT FROM EXCLUDED.node_id"
)
_ADD_PHASE = (
    "INSERT INTO node_task_phases (task_id, stream_seq, phase, detail, at, node_id) "
    "SELECT $1, $2, $3, $4, $5, $6 WHERE NOT EXISTS "
    "(SELECT 1 FROM node_tasks WHERE task_id = $1 AND node_id IS DISTINCT FROM $6) "
    "ON CONFLICT DO NOTHING"
)


def _allocation_values(row: dict[str, Any], newest: bool) -> tuple[Any, ...]:
    values = [_j(row.get(c)) if c in _ALLOCATION_JSON else row.get(c) for c in _ALLOCATION_COLUMNS]
    return (*values, newest)


def _facts_after(known: dict[str, Any] | None, row: dict[str, Any]) -> dict[str, Any]:
    """The allocation row's `_FACTS` once _UPSERT_ALLOCATION has merged `row` into it (`known`: before; None
    when there was no row): the statement's own rule, for a batch that reads the row before it writes it."""
    if known is None:
        return {c: row.get(c) for c in _FACTS}
    merged = {c: row.get(c) if known[c] is None else known[c] for c in ("sku", "gpu_count", "region", "node_id")}
    return {**merged, "tenant_id": known["tenant_id"] or row.get("tenant_id"), "shape": known["shape"]}


def _claim_rows(
    allocation_id: uuid.UUID, node_id: str, mode: str, slots: list[dict[str, Any]], at: datetime
) -> list[tuple[Any, ...]]:
    # A node-exclusive claim holds the node, with no slot.
    return [(allocation_id, node_id, slot_id, mode, at) for slot_id in [s["slot_id"] for s in slots] or [""]]


def _slot_rows(node_id: str, slots: list[dict[str, Any]], at: datetime) -> list[tuple[Any, ...]]:
    return [
        (
            node_id,
            s["slot_id"],
            s.get("profile"),
            s.get("gpu_pci_address"),
            s.get("nvme_by_id"),
            s.get("private_ip"),
            at,
        )
        for s in slots
    ]


def _task_values(row: dict[str, Any]) -> tuple[Any, ...]:
    return tuple(row[c] if c in ("task_id", "node_id", "status", "updated_at") else row.get(c) for c in _TASK_COLUMNS)


def _move(r: asyncpg.Record) -> Move:
    return Move(r["seq"], r["state"], r["at"], r["event_id"], r["reason_code"])


def _usage_values(allocation_id: uuid.UUID, usage: Usage, facts: dict[str, Any]) -> tuple[Any, ...]:
    return (
        allocation_id,
        facts.get("tenant_id") or "",
        facts.get("shape") or "",
        facts.get("sku"),
        facts.get("gpu_count"),
        facts.get("region"),
        facts.get("node_id"),
        usage.started_at,
        usage.stopped_at,
        usage.ended,
        usage.end_reason_code,
        usage.start_event_id,
        usage.stop_event_id,
    )


async def _pending(
    type_: str, payload: BaseModel, aggregate_id: str, event_id: str, causation_id: str | None
) -> list[PendingEvent]:
    events = EventCollector(PRODUCER, correlation_id=aggregate_id, causation_id=causation_id)
    await events.add(type_, payload, aggregate_id=aggregate_id, event_id=event_id)
    return events.pending


class Projection:
    def __init__(self, conn: asyncpg.Connection) -> None:
        self.conn = conn
        # The groups of the host-fed tables (host_rows.CAPPED) this transaction inserted into: `cap_host_rows`
        # trims them before its commit.
        self._grown: dict[Capped, set[str]] = {}

    def _grew(self, table: Capped, group: str) -> None:
        self._grown.setdefault(table, set()).add(group)

    async def cap_host_rows(self, per_group: int) -> dict[str, int]:
        """Keep each group this transaction grew at its newest `per_group` rows (host_rows.py); the rows deleted
        per table. After the transaction's last write of those tables, before its commit."""
        grown, self._grown = self._grown, {}
        return await trim(self.conn, grown, per_group)

    # --- positions --------------------------------------------------------------------------------------

    async def positions(self) -> dict[str, int]:
        return {
            r["stream"]: r["last_seq"] for r in await self.conn.fetch("SELECT stream, last_seq FROM stream_positions")
        }

    async def advance(self, stream: str, seq: int, at: datetime) -> None:
        # The NOTIFY is delivered at the commit, and only if it commits: the console's live pages refresh on it
        # (adapters/changes.py). One statement, one round trip a batch.
        await self.conn.execute(
            "WITH moved AS (INSERT INTO stream_positions (stream, last_seq, at) VALUES ($1, $2, $3) "
            "ON CONFLICT (stream) DO UPDATE SET last_seq = GREATEST(stream_positions.last_seq, $2), at = $3) "
            "SELECT pg_notify($4, $1)",
            stream,
            seq,
            at,
            CHANGED_CHANNEL,
        )

    # --- allocations ------------------------------------------------------------------------------------

    async def timeline_states(self, allocation_id: uuid.UUID) -> dict[int, str]:
        rows = await self.conn.fetch(
            "SELECT seq, state FROM allocation_timeline WHERE allocation_id = $1 FOR UPDATE", allocation_id
        )
        return {r["seq"]: r["state"] for r in rows}

    async def add_transition(
        self,
        allocation_id: uuid.UUID,
        seq: int,
        state: str,
        previous: str | None,
        event_id: str,
        at: datetime,
        detail: dict,
    ) -> None:
        await self.conn.execute(_ADD_TRANSITION, allocation_id, seq, state, previous, event_id, at, _j(detail))

    async def upsert_allocation(self, row: dict[str, Any], *, newest: bool) -> None:
        """`newest`: this event is the allocation's latest transition, so its state and reason replace the row's;
        an older one (read after a newer) only fills what is still unknown."""
        await self.conn.execute(_UPSERT_ALLOCATION, *_allocation_values(row, newest))

    async def place_claims(
        self, allocation_id: uuid.UUID, node_id: str, mode: str, slots: list[dict[str, Any]], at: datetime
    ) -> None:
        await self.conn.executemany(_PLACE_CLAIM, _claim_rows(allocation_id, node_id, mode, slots, at))
        await self.conn.executemany(_SEE_SLOT, _slot_rows(node_id, slots, at))

    async def end_claims(self, allocation_id: uuid.UUID, outcome: str, at: datetime) -> None:
        await self.conn.execute(_END_CLAIMS, allocation_id, at, outcome)

    async def forced_release(self, allocation_id: uuid.UUID, p: dict[str, Any], at: datetime) -> None:
        await self.conn.execute(
            "INSERT INTO forced_releases (allocation_id, actor, reason, node_ids, slot_ids, at) "
            "VALUES ($1, $2, $3, $4::jsonb, $5::jsonb, $6) ON CONFLICT DO NOTHING",
            allocation_id,
            p["actor"],
            p["reason"],
            _j(p.get("node_ids", [])),
            _j(p.get("slot_ids", [])),
            at,
        )

    # --- usage ------------------------------------------------------------------------------------------

    async def moves(self, allocation_id: uuid.UUID) -> list[Move]:
        rows = await self.conn.fetch(
            f"SELECT {_MOVE_COLUMNS} FROM allocation_timeline WHERE allocation_id = $1 ORDER BY seq", allocation_id
        )
        return [_move(r) for r in rows]

    async def allocation_facts(self, allocation_id: uuid.UUID) -> dict[str, Any]:
        row = await self.conn.fetchrow(
            f"SELECT {', '.join(_FACTS)} FROM allocations WHERE allocation_id = $1", allocation_id
        )
        return dict(row) if row is not None else {}

    async def usage_closed(self, allocation_id: uuid.UUID) -> bool | None:
        """Whether the allocation's usage record is closed; None when it has none yet."""
        return await self.conn.fetchval(
            "SELECT stopped_at IS NOT NULL FROM usage_records WHERE allocation_id = $1 FOR UPDATE", allocation_id
        )

    async def put_usage(self, allocation_id: uuid.UUID, usage: Usage, facts: dict[str, Any]) -> None:
        """Write the record as the timeline makes it (`usage`), with what the allocation's row knows."""
        await self.conn.execute(_PUT_USAGE, *_usage_values(allocation_id, usage, facts))

    async def publish(
        self, type_: str, payload: BaseModel, *, aggregate_id: str, event_id: str, causation_id: str | None
    ) -> None:
        """An event through the transactional outbox: written with the rows that made it, published by the
        relay after the commit (and never if the transaction rolls back)."""
        await write_pending(self.conn, SCHEMA, await _pending(type_, payload, aggregate_id, event_id, causation_id))

    # --- node tasks ---------------------------------------------------------------------------------------

    async def task_status(self, task_id: str) -> str | None:
        return await self.conn.fetchval("SELECT status FROM node_tasks WHERE task_id = $1 FOR UPDATE", task_id)

    async def upsert_task(self, row: dict[str, Any]) -> None:
        await self.conn.execute(_UPSERT_TASK, *_task_values(row))
        self._grew(NODE_TASKS, row["node_id"])

    async def add_phase(
        self, task_id: str, node_id: str, stream_seq: int, phase: str, detail: str | None, at: datetime
    ) -> None:
        """A phase the host `node_id` reported of its task."""
        await self.conn.execute(_ADD_PHASE, task_id, stream_seq, phase, detail, at, node_id)
        self._grew(NODE_TASK_PHASES, node_id)

    # --- fleet --------------------------------------------------------------------------------------------

    async def host_evidence(self, node_id: str, at: datetime, **fields: Any) -> None:
        """Set `fields` of a host (JSON ones encoded), creating it if this is the first word about it."""
        names = list(fields)
        values = [_j(v) if isinstance(v, (list, dict)) else v for v in fields.values()]
        casts = ["::jsonb" if isinstance(v, (list, dict)) else "" for v in fields.values()]
        placeholders = ", ".join(f"${i + 3}{cast}" for i, cast in enumerate(casts))
        sets = ", ".join(f"{n} = EXCLUDED.{n}" for n in names)
        await self.conn.execute(
            f"INSERT INTO hosts (node_id, updated_at, {', '.join(names)}) VALUES ($1, $2, {placeholders}) "
            f"ON CONFLICT (node_id) DO UPDATE SET {sets}, updated_at = GREATEST(hosts.updated_at, EXCLUDED.updated_at)",
            node_id,
            at,
            *values,
        )

    async def slots_announced(self, node_id: str) -> tuple[int, str] | None:
        """The number and event id of the newest announcement of the host's slots read so far (None: none), its
        row locked."""
        row = await self.conn.fetchrow(
            "SELECT slots_generation, slots_event_id FROM hosts WHERE node_id = $1 FOR UPDATE", node_id
        )
        if row is None or row["slots_generation"] is None:
            return None
        return row["slots_generation"], row["slots_event_id"]

    async def announce_slots(
        self, node_id: str, generation: int, event_id: str, slots: list[dict[str, Any]], at: datetime
    ) -> None:
        """The host's newest announcement (domain.models.place_announcement decided it is) and each of its slots."""
        await self.conn.execute(_ANNOUNCE_HOST, node_id, generation, event_id, at)
        rows = [
            (
                node_id,
                s["slot_id"],
                s["profile"],
                s.get("gpu_pci_address"),
                s.get("nvme_by_id"),
                s.get("private_ip"),
                at,
                s["status"],
                s.get("status_reason"),
                s["health_state"],
                s.get("health_detail"),
                generation,
                at,
            )
            for s in slots
        ]
        if rows:
            await self.conn.executemany(_ANNOUNCE_SLOT, rows)

    async def host_mode(
        self, event_id: str, node_id: str, from_mode: str, to_mode: str, actor: str, reason: str, at: datetime
    ) -> None:
        """A mode change: one history row (a replay writes none twice) and the host's mode, the latest by time."""
        await self.conn.execute(
            "INSERT INTO host_mode_history (event_id, node_id, from_mode, to_mode, actor, reason, at) "
            "VALUES ($1, $2, $3, $4, $5, $6, $7) ON CONFLICT (event_id) DO NOTHING",
            event_id,
            node_id,
            from_mode,
            to_mode,
            actor,
            reason,
            at,
        )
        await self.conn.execute(
            "INSERT INTO hosts (node_id, updated_at, mode, mode_changed_at) VALUES ($1, $2, $3, $2) "
            "ON CONFLICT (node_id) DO UPDATE SET mode = EXCLUDED.mode, mode_changed_at = EXCLUDED.mode_changed_at, "
            "updated_at = GREATEST(hosts.updated_at, EXCLUDED.updated_at) "
            "WHERE hosts.mode_changed_at IS NULL OR hosts.mode_changed_at <= EXCLUDED.mode_changed_at",
            node_id,
            at,
            to_mode,
        )

    # --- images -------------------------------------------------------------------------------------------

    async def image(self, slug: str, status: str | None, at: datetime, **fields: Any) -> None:
        names = list(fields)
        placeholders = ", ".join(f"${i + 4}" for i in range(len(names)))
        sets = "".join(f", {n} = COALESCE(EXCLUDED.{n}, images.{n})" for n in names)
        await self.conn.execute(
            f"INSERT INTO images (slug, status, updated_at{''.join(', ' + n for n in names)}) "
            f"VALUES ($1, COALESCE($2, 'building'), $3{', ' + placeholders if names else ''}) "
            f"ON CONFLICT (slug) DO UPDATE SET status = COALESCE($2, images.status), updated_at = $3{sets}",
            slug,
            status,
            at,
            *fields.values(),
        )

    async def image_cache(self, p: dict[str, Any], at: datetime) -> None:
        await self.conn.execute(
            "INSERT INTO image_caches (slug, node_id, status, digest_sha256, schedulable, updated_at) "
            "VALUES ($1, $2, $3, $4, $5, $6) ON CONFLICT (slug, node_id) DO UPDATE SET status = EXCLUDED.status, "
            "digest_sha256 = EXCLUDED.digest_sha256, schedulable = EXCLUDED.schedulable, "
            "updated_at = EXCLUDED.updated_at",
            p["slug"],
            p["node_id"],
            p["status"],
            p.get("digest_sha256"),
            p["schedulable"],
            at,
        )

    # --- MAAS ---------------------------------------------------------------------------------------------

    async def maas_status(self, operation_id: str) -> str | None:
        return await self.conn.fetchval(
            "SELECT status FROM maas_operations WHERE operation_id = $1 FOR UPDATE", operation_id
        )

    async def upsert_maas(self, row: dict[str, Any]) -> None:
        cols = (
            "operation_id",
            "op",
            "allocation_id",
            "node_id",
            "system_id",
            "status",
            "resolution",
            "reason_code",
            "status_message",
            "attempts",
            "requested_at",
            "resolved_at",
            "erase_mode",
            "erase_outcome",
            "updated_at",
        )
        fill = ", ".join(
            f"{c} = COALESCE(m.{c}, EXCLUDED.{c})"
            for c in cols[2:]
            if c not in ("status", "updated_at", "operation_id")
        )
        await self.conn.execute(
            f"INSERT INTO maas_operations AS m ({', '.join(cols)}) VALUES "
            f"({', '.join(f'${i + 1}' for i in range(len(cols)))}) ON CONFLICT (operation_id) DO UPDATE SET "
            f"status = EXCLUDED.status, {fill}, updated_at = GREATEST(m.updated_at, EXCLUDED.updated_at)",
            *[row.get(c) for c in cols],
        )

    # --- dead letters ---------------------------------------------------------------------------------------

    async def audit(self, event_id: str, p: dict[str, Any], at: datetime) -> None:
        await self.conn.execute(
            "INSERT INTO audit_records (event_id, service, request_id, principal, actor, method, path, status, "
            "error_code, replayed, idempotency_key, reason, at) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, "
            "$12, $13) ON CONFLICT DO NOTHING",
            event_id,
            p["service"],
            p["request_id"],
            p["principal"],
            p["actor"],
            p["method"],
            p["path"],
            p["status"],
            p.get("error_code"),
            p.get("replayed", False),
            p.get("idempotency_key"),
            p.get("reason"),
            at,
        )

    async def dead_letter(self, dlq_seq: int, subject: str, p: dict[str, Any], at: datetime) -> None:
        body = p.get("body_text")
        await self.conn.execute(
            "INSERT INTO dead_letters (dlq_seq, subject, consumer, stream, origin_subject, origin_seq, reason_code, "
            "reason, num_delivered, body_text, at) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11) "
            "ON CONFLICT DO NOTHING",
            dlq_seq,
            subject,
            p["consumer"],
            p["stream"],
            p["subject"],
            p.get("stream_seq"),
            p["reason_code"],
            p["reason"],
            p.get("num_delivered"),
            body[:16_384] if body is not None else None,
            at,
        )
        self._grew(DEAD_LETTERS, p["consumer"])


@dataclass
class _Known:
    """What a batch knows of one allocation: read once at its start, then kept by the batch's own events."""

    moves: dict[int, Move]  # its timeline, by seq
    facts: dict[str, Any] | None  # the `_FACTS` of its row; None while it has none
    usage_closed: bool | None  # as usage_closed() answers


@dataclass
class _ClaimRound:
    """Claim writes applied together: a round's placements before its ends. An allocation's claims placed after
    they ended in the same batch (its events read out of order) go in the next round, as one by one would."""

    placed: list[tuple[Any, ...]] = field(default_factory=list)
    slots: list[tuple[Any, ...]] = field(default_factory=list)
    ended: list[tuple[Any, ...]] = field(default_factory=list)
    ended_ids: set[uuid.UUID] = field(default_factory=set)


class BatchProjection(Projection):
    """The allocation and node task streams' writes for a whole batch in a handful of round trips, not several
    a message (~7 an allocation event): what the batch's allocations and tasks need is read at once (`load`:
    a query for the allocations, one for the tasks), the handlers read and change that (so two events of one
    allocation in a batch see each other, as one by one), and the writes go at the end (`flush`), one
    executemany per statement in stream order. Ends in the same rows, the same outbox events and the same
    failures as applying each message through `Projection`; whatever else a handler writes goes at once, as
    there. One a batch: `load`, the handlers, `flush`."""

    def __init__(self, conn: asyncpg.Connection) -> None:
        super().__init__(conn)
        self._known: dict[uuid.UUID, _Known] = {}
        self._transitions: list[tuple[Any, ...]] = []
        self._allocations: list[tuple[Any, ...]] = []
        self._claims: list[_ClaimRound] = [_ClaimRound()]
        self._usage: list[tuple[Any, ...]] = []
        self._pending: list[PendingEvent] = []
        self._task_status: dict[str, str | None] = {}
        self._tasks: list[tuple[Any, ...]] = []
        self._phases: list[tuple[Any, ...]] = []

    async def load(self, allocation_ids: set[uuid.UUID], task_ids: set[str]) -> None:
        """Read what the handlers ask of these allocations and node tasks, locked as their one-by-one reads
        lock it."""
        await self._load_allocations([i for i in allocation_ids if i not in self._known])
        tasks = [i for i in task_ids if i not in self._task_status]
        if tasks:
            self._task_status.update(dict.fromkeys(tasks))
            for r in await self.conn.fetch(
                "SELECT task_id, status FROM node_tasks WHERE task_id = ANY($1::text[]) FOR UPDATE", tasks
            ):
                self._task_status[r["task_id"]] = r["status"]

    async def _load_allocations(self, ids: list[uuid.UUID]) -> None:
        if not ids:
            return
        for r in await self.conn.fetch(_LOAD_ALLOCATIONS, ids):
            known = self._known.get(r["allocation_id"])
            if known is None:
                facts = {c: r[c] for c in _FACTS} if r["has_row"] else None
                known = self._known[r["allocation_id"]] = _Known({}, facts, r["usage_closed"])
            if r["seq"] is not None:
                known.moves[r["seq"]] = _move(r)

    async def _of(self, allocation_id: uuid.UUID) -> _Known:
        if allocation_id not in self._known:  # one the batch did not announce: read on its own
            await self._load_allocations([allocation_id])
        return self._known[allocation_id]

    async def flush(self) -> None:
        """Write what the batch's handlers left, in the order they left it within each statement."""
        if self._transitions:
            await self.conn.executemany(_ADD_TRANSITION, self._transitions)
        if self._allocations:
            await self.conn.executemany(_UPSERT_ALLOCATION, self._allocations)
        for claims in self._claims:
            if claims.placed:
                await self.conn.executemany(_PLACE_CLAIM, claims.placed)
            if claims.slots:
                await self.conn.executemany(_SEE_SLOT, claims.slots)
            if claims.ended:
                await self.conn.executemany(_END_CLAIMS, claims.ended)
        if self._usage:
            await self.conn.executemany(_PUT_USAGE, self._usage)
        if self._tasks:
            await self.conn.executemany(_UPSERT_TASK, self._tasks)
        if self._phases:
            await self.conn.executemany(_ADD_PHASE, self._phases)
        if self._pending:
            # One simple query, with a NOTIFY per event as each would have written alone: the relay's notices
            # stay small enough to carry their rows.
            await self.conn.execute("; ".join(pending_statement(SCHEMA, [p]) for p in self._pending))

    # --- allocations ------------------------------------------------------------------------------------

    async def timeline_states(self, allocation_id: uuid.UUID) -> dict[int, str]:
        return {seq: move.state for seq, move in (await self._of(allocation_id)).moves.items()}

    async def add_transition(
        self,
        allocation_id: uuid.UUID,
        seq: int,
        state: str,
        previous: str | None,
        event_id: str,
        at: datetime,
        detail: dict,
    ) -> None:
        known = await self._of(allocation_id)
        if seq in known.moves:  # ON CONFLICT DO NOTHING
            return
        known.moves[seq] = Move(seq, state, at, event_id, detail.get("reason_code"))
        self._transitions.append((allocation_id, seq, state, previous, event_id, at, _j(detail)))

    async def upsert_allocation(self, row: dict[str, Any], *, newest: bool) -> None:
        known = await self._of(row["allocation_id"])
        known.facts = _facts_after(known.facts, row)
        self._allocations.append(_allocation_values(row, newest))

    async def place_claims(
        self, allocation_id: uuid.UUID, node_id: str, mode: str, slots: list[dict[str, Any]], at: datetime
    ) -> None:
        if allocation_id in self._claims[-1].ended_ids:
            self._claims.append(_ClaimRound())
        claims = self._claims[-1]
        claims.placed += _claim_rows(allocation_id, node_id, mode, slots, at)
        claims.slots += _slot_rows(node_id, slots, at)

    async def end_claims(self, allocation_id: uuid.UUID, outcome: str, at: datetime) -> None:
        claims = self._claims[-1]
        claims.ended.append((allocation_id, at, outcome))
        claims.ended_ids.add(allocation_id)

    # --- usage ------------------------------------------------------------------------------------------

    async def moves(self, allocation_id: uuid.UUID) -> list[Move]:
        return sorted((await self._of(allocation_id)).moves.values(), key=lambda move: move.seq)

    async def allocation_facts(self, allocation_id: uuid.UUID) -> dict[str, Any]:
        return dict((await self._of(allocation_id)).facts or {})

    async def usage_closed(self, allocation_id: uuid.UUID) -> bool | None:
        return (await self._of(allocation_id)).usage_closed

    async def put_usage(self, allocation_id: uuid.UUID, usage: Usage, facts: dict[str, Any]) -> None:
        (await self._of(allocation_id)).usage_closed = usage.closed
        self._usage.append(_usage_values(allocation_id, usage, facts))

    async def publish(
        self, type_: str, payload: BaseModel, *, aggregate_id: str, event_id: str, causation_id: str | None
    ) -> None:
        self._pending += await _pending(type_, payload, aggregate_id, event_id, causation_id)

    # --- node tasks ---------------------------------------------------------------------------------------

    async def task_status(self, task_id: str) -> str | None:
        if task_id not in self._task_status:  # one the batch did not announce: read on its own
            await self.load(set(), {task_id})
        return self._task_status[task_id]

    async def upsert_task(self, row: dict[str, Any]) -> None:
        # The status _UPSERT_TASK's merge leaves (domain.models.task_status: the same rule).
        self._task_status[row["task_id"]] = task_status(await self.task_status(row["task_id"]), row["status"])
        self._tasks.append(_task_values(row))
        self._grew(NODE_TASKS, row["node_id"])

    async def add_phase(
        self, task_id: str, node_id: str, stream_seq: int, phase: str, detail: str | None, at: datetime
    ) -> None:
        self._phases.append((task_id, stream_seq, phase, detail, at, node_id))
        self._grew(NODE_TASK_PHASES, node_id)
