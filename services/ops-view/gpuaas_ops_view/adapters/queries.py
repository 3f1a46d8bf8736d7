"""Every statement that reads the read models for the ops API: `ReadModels`, one connection's reads, the
service layer's `OpsReads` port (service_layer/ports.py). Rows come out as plain dicts, JSON columns decoded."""

from __future__ import annotations

import json
import uuid
from datetime import datetime
from typing import Any

import asyncpg

from ..domain.filters import AllocationFilter, Page


def _row(record: asyncpg.Record) -> dict[str, Any]:
    out = dict(record)
    for key, value in out.items():
        if isinstance(value, str) and key in _JSON_COLUMNS:
            out[key] = json.loads(value)
    return out


_JSON_COLUMNS = frozenset(
    {"access", "why_not", "detail", "parity_failing", "topology_blockers", "drift", "node_ids", "slot_ids"}
)


class _Where:
    def __init__(self) -> None:
        self.terms: list[str] = []
        self.args: list[Any] = []

    def add(self, term: str, *values: Any) -> None:
        names = []
        for value in values:
            self.args.append(value)
            names.append(f"${len(self.args)}")
        self.terms.append(term.format(*names))

    def sql(self) -> str:
        return f"WHERE {' AND '.join(self.terms)}" if self.terms else ""


def _keyset(where: _Where, page: Page, time_col: str, id_col: str, id_type: str) -> None:
    if page.after is not None:
        at, row_id = page.after
        where.add(f"({time_col}, {id_col}) < ({{}}::timestamptz, {{}}::{id_type})", datetime.fromisoformat(at), row_id)


def _time_range(where: _Where, col: str, since: datetime | None, until: datetime | None) -> None:
    if since is not None:
        where.add(f"{col} >= {{}}", since)
    if until is not None:
        where.add(f"{col} < {{}}", until)


_TASKS_WITH_PHASES = (
    "SELECT t.*, COALESCE((SELECT jsonb_agg(jsonb_build_object('phase', p.phase, 'detail', p.detail, 'at', p.at) "
    "ORDER BY p.stream_seq) FROM node_task_phases p WHERE p.task_id = t.task_id), '[]') AS phases "
    "FROM node_tasks t "
)


def _with_phases(rows: list[asyncpg.Record]) -> list[dict[str, Any]]:
    out = []
    for r in rows:
        row = _row(r)
        row["phases"] = json.loads(row["phases"]) if isinstance(row["phases"], str) else row["phases"]
        out.append(row)
    return out


# The records a month [{ms}, {me}) holds: those whose [start, stop) meets it (a running one's stop is {now}), and
# one that started and stopped in the same second within it (0 s, still a record).
_IN_MONTH = (
    "started_at < {me} AND (COALESCE(stopped_at, {now}) > {ms} OR (stopped_at = started_at AND started_at >= {ms}))"
)
# Its whole seconds inside the month (domain/usage.py seconds_within, in SQL for the month's totals); every time
# in it is a whole second, so the difference is too.
_SECONDS_IN = (
    "GREATEST(0, EXTRACT(EPOCH FROM LEAST(COALESCE(stopped_at, {now}), {me}) - GREATEST(started_at, {ms})))::bigint"
)


def _usage_where(tenant: str | None, since: datetime, until: datetime, now: datetime) -> tuple[_Where, str]:
    """The month's filter, and the seconds expression over the same parameters."""
    names = {"ms": "$1", "me": "$2", "now": "$3"}
    where = _Where()
    where.args = [since, until, now]
    where.terms = [_IN_MONTH.format(**names)]
    if tenant:
        where.add("tenant_id = {}", tenant)
    return where, _SECONDS_IN.format(**names)


class ReadModels:
    """The read models' reads on one connection (the request's, from the pool)."""

    def __init__(self, conn: asyncpg.Connection) -> None:
        self.conn = conn

    async def list_allocations(self, f: AllocationFilter) -> list[dict[str, Any]]:
        where = _Where()
        if f.tenant:
            where.add("tenant_id = {}", f.tenant)
        if f.state:
            where.add("state = {}", f.state)
        if f.node:
            where.add("node_id = {}", f.node)
        _time_range(where, "created_at", f.since, f.until)
        _keyset(where, f.page, "created_at", "allocation_id", "uuid")
        rows = await self.conn.fetch(
            f"SELECT * FROM allocations {where.sql()} ORDER BY created_at DESC, allocation_id DESC "
            f"LIMIT {f.page.limit + 1}",
            *where.args,
        )
        return [_row(r) for r in rows]

    async def allocation(self, allocation_id: uuid.UUID) -> dict[str, Any] | None:
        row = await self.conn.fetchrow("SELECT * FROM allocations WHERE allocation_id = $1", allocation_id)
        return None if row is None else _row(row)

    async def timeline(self, allocation_id: uuid.UUID) -> list[dict[str, Any]]:
        rows = await self.conn.fetch(
            "SELECT seq, state, previous_state, event_id, at, detail FROM allocation_timeline WHERE allocation_id = $1 "
            "ORDER BY seq",
            allocation_id,
        )
        return [_row(r) for r in rows]

    async def claims(
        self, *, allocation_id: uuid.UUID | None = None, node_id: str | None = None
    ) -> list[dict[str, Any]]:
        where = _Where()
        if allocation_id is not None:
            where.add("c.allocation_id = {}", allocation_id)
        if node_id is not None:
            where.add("c.node_id = {}", node_id)
        rows = await self.conn.fetch(
            "SELECT c.allocation_id, c.node_id, c.slot_id, c.claim_mode, c.placed_at, c.released_at, c.outcome, "
            "f.actor AS forced_by, f.reason AS forced_reason FROM claims c "
            f"LEFT JOIN forced_releases f USING (allocation_id) {where.sql()} ORDER BY c.placed_at, c.slot_id",
            *where.args,
        )
        return [_row(r) for r in rows]

    async def tasks(self, allocation_id: uuid.UUID) -> list[dict[str, Any]]:
        rows = await self.conn.fetch(
            _TASKS_WITH_PHASES + "WHERE t.allocation_id = $1 ORDER BY COALESCE(t.sent_at, t.updated_at), t.task_id",
            allocation_id,
        )
        return _with_phases(rows)

    async def host_tasks(self, node_id: str, limit: int = 50) -> list[dict[str, Any]]:
        """The host's own tasks (no allocation's: its slot wipes), newest first."""
        rows = await self.conn.fetch(
            _TASKS_WITH_PHASES + "WHERE t.node_id = $1 AND t.allocation_id IS NULL "
            "ORDER BY COALESCE(t.sent_at, t.updated_at) DESC, t.task_id LIMIT $2",
            node_id,
            limit,
        )
        return _with_phases(rows)

    async def list_hosts(self, node: str | None, kind: str | None, page: Page) -> list[dict[str, Any]]:
        where = _Where()
        if node:
            where.add("node_id = {}", node)
        if kind:
            where.add("kind = {}", kind)
        if page.after is not None:
            where.add("node_id > {}", page.after[1])
        rows = await self.conn.fetch(
            f"SELECT * FROM hosts {where.sql()} ORDER BY node_id LIMIT {page.limit + 1}", *where.args
        )
        return [_row(r) for r in rows]

    async def host(self, node_id: str) -> dict[str, Any] | None:
        row = await self.conn.fetchrow("SELECT * FROM hosts WHERE node_id = $1", node_id)
        return None if row is None else _row(row)

    async def unknown_host(self, node_id: str) -> dict[str, Any]:
        """A host the streams named only through its claims: every column of the model, none known yet."""
        columns = [a.name for a in (await self.conn.prepare("SELECT * FROM hosts")).get_attributes()]
        return {**dict.fromkeys(columns), "node_id": node_id}

    async def mode_history(self, node_id: str, limit: int = 50) -> list[dict[str, Any]]:
        rows = await self.conn.fetch(
            "SELECT from_mode, to_mode, actor, reason, at FROM host_mode_history WHERE node_id = $1 "
            f"ORDER BY at DESC, event_id LIMIT {int(limit)}",
            node_id,
        )
        return [_row(r) for r in rows]

    async def slots(self, node_id: str) -> list[dict[str, Any]]:
        return [
            _row(r) for r in await self.conn.fetch("SELECT * FROM slots WHERE node_id = $1 ORDER BY slot_id", node_id)
        ]

    async def list_images(self) -> list[dict[str, Any]]:
        rows = await self.conn.fetch(
            "SELECT i.*, COALESCE((SELECT jsonb_object_agg(c.status, c.n) FROM (SELECT status, count(*) AS n "
            "FROM image_caches WHERE slug = i.slug GROUP BY status) c), '{}') AS caches FROM images i ORDER BY slug"
        )
        return [
            {**_row(r), "caches": json.loads(r["caches"]) if isinstance(r["caches"], str) else r["caches"]}
            for r in rows
        ]

    async def image(self, slug: str) -> dict[str, Any] | None:
        row = await self.conn.fetchrow("SELECT * FROM images WHERE slug = $1", slug)
        return None if row is None else _row(row)

    async def image_caches(self, slug: str) -> list[dict[str, Any]]:
        rows = await self.conn.fetch("SELECT * FROM image_caches WHERE slug = $1 ORDER BY node_id", slug)
        return [_row(r) for r in rows]

    async def list_maas(
        self, status: str | None, node: str | None, since: datetime | None, until: datetime | None, page: Page
    ) -> list[dict[str, Any]]:
        where = _Where()
        if status == "in_flight":
            where.add("status = 'requested'")
        elif status:
            where.add("status = {}", status)
        if node:
            where.add("node_id = {}", node)
        _time_range(where, "updated_at", since, until)
        _keyset(where, page, "updated_at", "operation_id", "text")
        rows = await self.conn.fetch(
            f"SELECT * FROM maas_operations {where.sql()} ORDER BY updated_at DESC, operation_id DESC "
            f"LIMIT {page.limit + 1}",
            *where.args,
        )
        return [_row(r) for r in rows]

    async def list_dead_letters(
        self,
        consumer: str | None,
        reason_code: str | None,
        since: datetime | None,
        until: datetime | None,
        page: Page,
    ) -> list[dict[str, Any]]:
        where = _Where()
        if consumer:
            where.add("consumer = {}", consumer)
        if reason_code:
            where.add("reason_code = {}", reason_code)
        _time_range(where, "at", since, until)
        if page.after is not None:
            where.add("dlq_seq < {}", int(page.after[1]))
        rows = await self.conn.fetch(
            f"SELECT * FROM dead_letters {where.sql()} ORDER BY dlq_seq DESC LIMIT {page.limit + 1}", *where.args
        )
        return [_row(r) for r in rows]

    async def list_audit(
        self,
        actor: str | None,
        service: str | None,
        request_id: str | None,
        since: datetime | None,
        until: datetime | None,
        page: Page,
    ) -> list[dict[str, Any]]:
        where = _Where()
        if actor:
            where.add("actor = {}", actor)
        if service:
            where.add("service = {}", service)
        if request_id:
            where.add("request_id = {}", request_id)
        _time_range(where, "at", since, until)
        _keyset(where, page, "at", "event_id", "text")
        rows = await self.conn.fetch(
            f"SELECT * FROM audit_records {where.sql()} ORDER BY at DESC, event_id DESC LIMIT {page.limit + 1}",
            *where.args,
        )
        return [_row(r) for r in rows]

    async def positions(self) -> dict[str, dict[str, Any]]:
        rows = await self.conn.fetch("SELECT stream, last_seq, at FROM stream_positions")
        return {r["stream"]: {"last_seq": r["last_seq"], "at": r["at"]} for r in rows}

    async def list_usage(
        self, tenant: str | None, since: datetime, until: datetime, now: datetime, page: Page
    ) -> list[dict[str, Any]]:
        """The month's usage records, oldest start first."""
        where, _ = _usage_where(tenant, since, until, now)
        if page.after is not None:
            at, row_id = page.after
            where.add("(started_at, allocation_id) > ({}::timestamptz, {}::uuid)", datetime.fromisoformat(at), row_id)
        rows = await self.conn.fetch(
            f"SELECT * FROM usage_records {where.sql()} ORDER BY started_at, allocation_id LIMIT {page.limit + 1}",
            *where.args,
        )
        return [_row(r) for r in rows]

    async def usage_totals(self, tenant: str | None, since: datetime, until: datetime, now: datetime) -> dict[str, Any]:
        where, seconds = _usage_where(tenant, since, until, now)
        row = await self.conn.fetchrow(
            f"SELECT count(*) AS records, count(*) FILTER (WHERE stopped_at IS NULL) AS open, "
            f"COALESCE(sum({seconds}), 0)::bigint AS seconds, "
            f"COALESCE(sum({seconds} * gpu_count), 0)::bigint AS gpu_seconds FROM usage_records {where.sql()}",
            *where.args,
        )
        return dict(row)
