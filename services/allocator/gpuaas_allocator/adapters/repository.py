"""Postgres access for allocations, their timeline and the known active images."""

from __future__ import annotations

import abc
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from datetime import datetime
from typing import Any

import asyncpg

from gpuaas_common.contract import Envelope
from gpuaas_common.db import value_literal

from ..domain.allocation import Allocation, TimelineEntry
from ..domain.commands import Policy
from ..domain.model import ActiveImage
from .metrics import STATE_ENTERED_SQL, TIME_IN_STATE
from .terminal_sessions import TerminalSessionRepository


class AllocationStore(abc.ABC):
    """The `Allocation` aggregate over a repository's row statements: the Postgres repository below and the
    handler tests' in-memory one share it, so both load and save an allocation the same way."""

    @abc.abstractmethod
    async def lock(self, allocation_id: uuid.UUID) -> dict[str, Any] | None: ...

    @abc.abstractmethod
    def last_seq(self, allocation_id: uuid.UUID) -> int:
        """The timeline's last seq of an allocation this unit of work locked or created."""

    @abc.abstractmethod
    async def insert(self, **fields: Any) -> None: ...

    @abc.abstractmethod
    async def lock_machine_holders(self, node_id: str) -> list[dict[str, Any]]: ...

    @abc.abstractmethod
    async def update(self, allocation_id: uuid.UUID, **fields: Any) -> None: ...

    @abc.abstractmethod
    async def append_timeline(
        self,
        allocation_id: uuid.UUID,
        state: str,
        previous_state: str | None,
        *,
        reason_code: str | None = None,
        detail: dict[str, Any] | None = None,
        cause_event_id: str | None = None,
    ) -> int: ...

    async def get(self, allocation_id: uuid.UUID, policy: Policy, cause: Envelope | None = None) -> Allocation | None:
        """The allocation, locked until the unit of work ends; `cause`: the message being handled."""
        row = await self.lock(allocation_id)
        return None if row is None else self.aggregate(row, policy, cause)

    def state_entered(self, allocation_id: uuid.UUID) -> float | None:
        """When (time.monotonic()) the allocation entered its current state, where this unit of work knows it."""
        return None

    def entered_state(self, allocation_id: uuid.UUID, at: float) -> None:
        """A move this unit of work wrote: the allocation entered its new state at `at` (kept where it is known)."""
        return None

    def aggregate(self, row: dict[str, Any], policy: Policy, cause: Envelope | None = None) -> Allocation:
        """A row this unit of work locked, as the aggregate."""
        return Allocation.from_row(row, last_seq=self.last_seq(row["allocation_id"]), policy=policy, cause=cause)

    async def append_entries(self, allocation_id: uuid.UUID, entries: Sequence[TimelineEntry]) -> None:
        """The aggregate's timeline rows, in order, one `append_timeline` each."""
        for entry in entries:
            seq = await self.append_timeline(
                allocation_id,
                entry.state,
                entry.previous_state,
                reason_code=entry.reason_code,
                detail=entry.detail,
                cause_event_id=entry.cause_event_id,
            )
            if seq != entry.seq:
                # The lifecycle events already carry the aggregate's count: another one would misnumber them.
                raise RuntimeError(f"{allocation_id}: timeline seq {seq} written, {entry.seq} counted")

    async def save(self, alloc: Allocation) -> None:
        """Write what the allocation recorded in the caller's unit of work: its columns, then its timeline rows
        (the Postgres repository holds them for the COMMIT). Its messages are the service layer's to hand to the
        outbox."""
        now = time.monotonic()
        entered = now if alloc.is_new else self.state_entered(alloc.allocation_id)
        await self.write(alloc.allocation_id, alloc.is_new, alloc.changes, alloc.timeline)
        for entry in alloc.timeline:
            if entry.previous_state is not None and entry.state != entry.previous_state:
                if entered is not None:
                    TIME_IN_STATE.labels(alloc.shape, entry.previous_state).observe(max(0.0, now - entered))
                entered = now
                self.entered_state(alloc.allocation_id, now)
        alloc.is_new, alloc.changes, alloc.timeline = False, {}, []

    async def write(
        self, allocation_id: uuid.UUID, is_new: bool, changes: dict[str, Any], entries: Sequence[TimelineEntry]
    ) -> None:
        """The row (inserted, or its changed columns) and then its timeline rows."""
        if is_new:
            await self.insert(**changes)
        elif changes:
            await self.update(allocation_id, **changes)
        await self.append_entries(allocation_id, entries)


class AllocationRepository(AllocationStore):
    """Every statement the allocator's handlers run, on the unit of work's connection and in its transaction:
    each one sent when it is called, with parameters (asyncpg prepares it once per connection), so an error
    surfaces at the statement that caused it -- except an allocation's save, which is held for the COMMIT
    (`unit_of_work.WritesAtCommit`): a save is the last thing a handler does with its allocation, and sent on its
    own it was a round trip per message that cost the allocator ~0.8 ms of CPU per allocation in the pipeline
    benchmark (5 saves), 6 % of the control plane's. Any other statement of this repository sends the held
    writes first (`_Flushing`), so nothing reads around them. The timeline's next sequence number is known without
    asking because the allocation is locked (`lock` reads the last one) or was created in this unit of work."""

    def __init__(self, conn: asyncpg.Connection) -> None:
        self._held: list[str] = []
        self.conn: Any = _Flushing(conn, self._held)
        # Last timeline seq of each allocation this unit of work locked or created: nobody else writes it meanwhile.
        self._last_seq: dict[uuid.UUID, int] = {}
        # Allocations this unit of work locked, by whether they had early task results then. Only a holder of the
        # allocation's lock keeps one (`keep_early_result`), so the answer holds until the unit of work ends.
        self._early: dict[uuid.UUID, bool] = {}
        # When each allocation this unit of work locked entered its current state (time.monotonic()).
        self._entered: dict[uuid.UUID, float] = {}
        # Through the flushing connection too, so its statements keep their order with the held writes.
        self.terminal = TerminalSessionRepository(self.conn)

    async def lock(self, allocation_id: uuid.UUID) -> dict[str, Any] | None:
        """The allocation, locked until the unit of work ends: messages about one allocation serialise here."""
        row = await self.conn.fetchrow(
            "SELECT a.*, (SELECT COALESCE(MAX(t.seq), 0) FROM allocation_timeline t "
            "WHERE t.allocation_id = a.allocation_id) AS last_timeline_seq_, "
            "EXISTS (SELECT 1 FROM early_task_results e WHERE e.allocation_id = a.allocation_id) AS has_early_, "
            f"EXTRACT(EPOCH FROM clock_timestamp() - ({STATE_ENTERED_SQL})) AS state_age_ "
            "FROM allocations a WHERE a.allocation_id = $1 FOR UPDATE OF a",
            allocation_id,
        )
        if row is None:
            # Nothing to lock; a row this unit of work inserts has no timeline yet (`insert`).
            self._last_seq.pop(allocation_id, None)
            self._early.pop(allocation_id, None)
            return None
        out = dict(row)
        self._last_seq[allocation_id] = out.pop("last_timeline_seq_")
        self._early[allocation_id] = out.pop("has_early_")
        age = out.pop("state_age_")
        if age is not None:
            self._entered[allocation_id] = time.monotonic() - float(age)
        for key in ("request", "placement", "access", "phase_marks"):
            if isinstance(out.get(key), str):
                out[key] = json.loads(out[key])
        return out

    def last_seq(self, allocation_id: uuid.UUID) -> int:
        """The timeline's last seq of an allocation this unit of work locked or created."""
        return self._last_seq[allocation_id]

    def state_entered(self, allocation_id: uuid.UUID) -> float | None:
        return self._entered.get(allocation_id)

    def entered_state(self, allocation_id: uuid.UUID, at: float) -> None:
        self._entered[allocation_id] = at

    async def _lock_due(self, where: str, order_by: str, after_s: float, limit: int) -> list[dict[str, Any]]:
        """Rows matching `where` (with `$1` the seconds they have waited), oldest `order_by` first, locked until
        the unit of work ends; rows another replica's sweep (or a handler) holds are skipped, so two replicas
        never act on one allocation twice. Both clauses are this module's own constants, never input."""
        rows = await self.conn.fetch(
            f"SELECT allocation_id FROM allocations WHERE {where} ORDER BY {order_by} LIMIT $2 FOR UPDATE SKIP LOCKED",
            after_s,
            limit,
        )
        out = []
        for r in rows:
            row = await self.lock(r["allocation_id"])  # already ours: the full row, JSON decoded
            if row is not None:
                out.append(row)
        return out

    async def lock_overdue(self, grace_s: float, limit: int) -> list[dict[str, Any]]:
        """Allocations whose node task is past its deadline plus `grace_s` (in a failed allocation: the teardown
        of a VM built late, see domain/allocation.py, late answers)."""
        return await self._lock_due(
            "awaiting_result AND task_deadline_at IS NOT NULL "
            "AND (state IN ('provisioning', 'releasing') OR (state = 'failed' AND release_task_id IS NOT NULL)) "
            "AND task_deadline_at + make_interval(secs => $1) < now()",
            "task_deadline_at",
            grace_s,
            limit,
        )

    async def lock_awaiting_maas(self, after_s: float, limit: int) -> list[dict[str, Any]]:
        """Baremetal allocations waiting for a MAAS result with nothing done to them for `after_s` (in a failed
        allocation: the release of its machine, see domain/allocation.py, failed machines)."""
        return await self._lock_due(
            "shape = 'baremetal' AND awaiting_result "
            "AND (state IN ('provisioning', 'releasing') OR (state = 'failed' AND release_operation_id IS NOT NULL)) "
            "AND coalesce(release_operation_id, operation_id) IS NOT NULL "
            "AND updated_at + make_interval(secs => $1) < now()",
            "updated_at",
            after_s,
            limit,
        )

    async def lock_awaiting_enrolment(self, after_s: float, limit: int) -> list[dict[str, Any]]:
        """Baremetal allocations deployed by MAAS whose host has not enrolled `after_s` after the deploy result."""
        return await self._lock_due(
            "shape = 'baremetal' AND state = 'provisioning' AND deployed AND NOT enrolled AND NOT awaiting_result "
            "AND updated_at + make_interval(secs => $1) < now()",
            "updated_at",
            after_s,
            limit,
        )

    async def lock_machine_holders(self, node_id: str) -> list[dict[str, Any]]:
        """Baremetal allocations whose tenant has (or may still have) `node_id`'s machine: deployed or being
        deployed, or failed with its machine not yet back from MAAS. Each locked (waiting for a handler that holds
        it) until the unit of work ends."""
        ids = await self.conn.fetch(
            "SELECT allocation_id FROM allocations WHERE shape = 'baremetal' AND node_id = $1 "
            "AND operation_id IS NOT NULL AND (state IN ('provisioning', 'active', 'releasing') "
            "OR (state = 'failed' AND (release_operation_id IS NULL OR awaiting_result))) ORDER BY created_at",
            node_id,
        )
        rows = [await self.lock(r["allocation_id"]) for r in ids]
        return [r for r in rows if r is not None]

    async def lock_awaiting_placement(self, after_s: float, limit: int) -> list[dict[str, Any]]:
        """Allocations still waiting for a placement answer with nothing done to them for `after_s`."""
        return await self._lock_due(
            "node_id IS NULL AND state IN ('accepted', 'releasing') AND updated_at + make_interval(secs => $1) < now()",
            "updated_at",
            after_s,
            limit,
        )

    async def accepted_seq(self, allocation_id: uuid.UUID) -> int | None:
        """The lifecycle sequence number of the allocation's `accepted` event."""
        return await self.conn.fetchval(
            "SELECT min(seq) FROM allocation_timeline WHERE allocation_id = $1 AND state = 'accepted'", allocation_id
        )

    async def keep_early_result(
        self, allocation_id: uuid.UUID, task_id: str, node_id: str, result: Any, event_id: str
    ) -> bool:
        """Keep a result that arrived before the allocation knew its task; False when one is already kept."""
        self._early[allocation_id] = True
        status = await self.conn.execute(
            "INSERT INTO early_task_results (allocation_id, task_id, node_id, result, event_id) "
            "VALUES ($1, $2, $3, $4, $5) ON CONFLICT DO NOTHING",
            allocation_id,
            task_id,
            node_id,
            json.dumps(result),
            event_id,
        )
        return status.endswith(" 1")

    async def take_early_result(self, allocation_id: uuid.UUID, task_id: str) -> dict[str, Any] | None:
        """The kept result of this task, removed: it is applied (or judged) once. No statement when the lock
        this unit of work holds found none kept (the common case: one round trip less per placement)."""
        if self._early.get(allocation_id) is False:
            return None
        row = await self.conn.fetchrow(
            "DELETE FROM early_task_results WHERE allocation_id = $1 AND task_id = $2 RETURNING node_id, result",
            allocation_id,
            task_id,
        )
        if row is None:
            return None
        result = row["result"]
        return {"node_id": row["node_id"], "result": json.loads(result) if isinstance(result, str) else result}

    async def write(
        self, allocation_id: uuid.UUID, is_new: bool, changes: dict[str, Any], entries: Sequence[TimelineEntry]
    ) -> None:
        """The row (inserted, or its changed columns) and its timeline rows, held for the COMMIT."""
        if is_new:
            self._held.append(_insert_literal(changes))
            self._last_seq[allocation_id] = 0
        elif changes:
            self._held.append(_update_literal(allocation_id, changes))
        if entries:
            self._held.append(_timeline_literal(allocation_id, entries))
            self._last_seq[allocation_id] = entries[-1].seq

    def take_writes(self) -> list[str]:
        """The held writes, for the unit of work's COMMIT; none are held after."""
        held = list(self._held)
        self._held.clear()
        return held

    async def insert(self, **fields: Any) -> None:
        await self.conn.execute(_insert_sql(fields), *_values(fields))
        self._last_seq[fields["allocation_id"]] = 0

    async def update(self, allocation_id: uuid.UUID, **fields: Any) -> None:
        await self.conn.execute(_update_sql(fields), allocation_id, *_values(fields))

    async def append_timeline(
        self,
        allocation_id: uuid.UUID,
        state: str,
        previous_state: str | None,
        *,
        reason_code: str | None = None,
        detail: dict[str, Any] | None = None,
        cause_event_id: str | None = None,
    ) -> int:
        """One timeline row, numbered by Postgres: right whether or not this unit of work locked the allocation."""
        seq: int = await self.conn.fetchval(
            "INSERT INTO allocation_timeline (allocation_id, seq, state, previous_state, reason_code, detail, "
            "cause_event_id) SELECT $1, COALESCE(MAX(seq), 0) + 1, $2, $3, $4, $5, $6 FROM allocation_timeline "
            "WHERE allocation_id = $1 RETURNING seq",
            allocation_id,
            state,
            previous_state,
            reason_code,
            json.dumps(detail or {}),
            cause_event_id,
        )
        if allocation_id in self._last_seq:
            self._last_seq[allocation_id] = seq
        return seq

    async def get_image(self, slug: str) -> ActiveImage | None:
        row = await self.conn.fetchrow(
            "SELECT slug, kind, sku, digest_sha256, image_path, driver_strategy, driver_version FROM active_images "
            "WHERE slug = $1",
            slug,
        )
        return ActiveImage(**dict(row)) if row else None

    async def upsert_image(self, image: ActiveImage) -> None:
        await self.conn.execute(
            "INSERT INTO active_images (slug, kind, sku, digest_sha256, image_path, driver_strategy, driver_version) "
            "VALUES ($1, $2, $3, $4, $5, $6, $7) "
            "ON CONFLICT (slug) DO UPDATE SET kind = EXCLUDED.kind, sku = EXCLUDED.sku, "
            "digest_sha256 = EXCLUDED.digest_sha256, image_path = EXCLUDED.image_path, "
            "driver_strategy = EXCLUDED.driver_strategy, driver_version = EXCLUDED.driver_version, updated_at = now()",
            image.slug,
            image.kind,
            image.sku,
            image.digest_sha256,
            image.image_path,
            image.driver_strategy,
            image.driver_version,
        )

    async def delete_image(self, slug: str) -> None:
        await self.conn.execute("DELETE FROM active_images WHERE slug = $1", slug)

    async def advance_image_clock(self, slug: str, occurred_at: datetime) -> bool:
        """Record an image event as the slug's newest and lock the slug's clock row until commit; False
        (nothing changed) when an event as new or newer was applied already. Never later than now: one
        event dated in the future must not freeze the slug."""
        return bool(
            await self.conn.fetchval(
                "INSERT INTO image_event_clock (slug, event_at) VALUES ($1, LEAST($2::timestamptz, now())) "
                "ON CONFLICT (slug) DO UPDATE SET event_at = EXCLUDED.event_at "
                "WHERE image_event_clock.event_at < EXCLUDED.event_at RETURNING 1",
                slug,
                occurred_at,
            )
        )


def _insert_literal(fields: dict[str, Any]) -> str:
    return f"INSERT INTO allocations ({', '.join(fields)}) VALUES ({', '.join(map(value_literal, _values(fields)))})"


def _update_literal(allocation_id: uuid.UUID, fields: dict[str, Any]) -> str:
    sets = "".join(f"{col} = {value_literal(v)}, " for col, v in zip(fields, _values(fields), strict=True))
    return f"UPDATE allocations SET {sets}updated_at = now() WHERE allocation_id = {value_literal(allocation_id)}"


def _timeline_row(allocation_id: uuid.UUID, e: TimelineEntry) -> tuple[Any, ...]:
    """A timeline row's values, in `_timeline_literal`'s column order."""
    return (
        allocation_id,
        e.seq,
        e.state,
        e.previous_state,
        e.reason_code,
        json.dumps(e.detail or {}),
        e.cause_event_id,
    )


def _timeline_literal(allocation_id: uuid.UUID, entries: Sequence[TimelineEntry]) -> str:
    rows = ", ".join(f"({', '.join(map(value_literal, _timeline_row(allocation_id, e)))})" for e in entries)
    return (
        "INSERT INTO allocation_timeline (allocation_id, seq, state, previous_state, reason_code, detail, "
        f"cause_event_id) VALUES {rows}"
    )


class _Flushing:
    """The connection as the repository uses it: a statement goes after the writes held for the COMMIT, which
    are sent first (one simple query), so a read sees them and writes keep their order."""

    def __init__(self, conn: asyncpg.Connection, held: list[str]) -> None:
        self._conn, self._held = conn, held

    async def _flush(self) -> None:
        if self._held:
            statements = "; ".join(self._held)
            self._held.clear()
            await self._conn.execute(statements)

    async def execute(self, query: str, *args: Any) -> str:
        await self._flush()
        return await self._conn.execute(query, *args)

    async def executemany(self, query: str, args: Any) -> None:
        await self._flush()
        await self._conn.executemany(query, args)

    async def fetch(self, query: str, *args: Any) -> list[asyncpg.Record]:
        await self._flush()
        return await self._conn.fetch(query, *args)

    async def fetchrow(self, query: str, *args: Any) -> asyncpg.Record | None:
        await self._flush()
        return await self._conn.fetchrow(query, *args)

    async def fetchval(self, query: str, *args: Any) -> Any:
        await self._flush()
        return await self._conn.fetchval(query, *args)


def _insert_sql(fields: dict[str, Any]) -> str:
    params = ", ".join(f"${i}" for i in range(1, len(fields) + 1))
    return f"INSERT INTO allocations ({', '.join(fields)}) VALUES ({params})"


def _update_sql(fields: dict[str, Any]) -> str:
    # One statement text per set of columns a method of the aggregate changes: a few dozen, each prepared once
    # per connection. $1 is the allocation's id.
    sets = "".join(f"{col} = ${i}, " for i, col in enumerate(fields, start=2))
    return f"UPDATE allocations SET {sets}updated_at = now() WHERE allocation_id = $1"


def _values(fields: dict[str, Any]) -> list[Any]:
    return [json.dumps(v) if isinstance(v, (dict, list)) else v for v in fields.values()]


async def count_images(pool: asyncpg.Pool) -> int:
    return await pool.fetchval("SELECT count(*) FROM active_images")


# --- reads for allocation queries (no lock, no unit of work: a query changes nothing) ------------------

_SUMMARY_COLUMNS = (
    "allocation_id, tenant_id, shape, sku, gpu_count, region, image_slug AS image, state, node_id, access, "
    "failure_code, failure_reason, created_at, updated_at"
)


def _decoded(row: asyncpg.Record) -> dict[str, Any]:
    out = dict(row)
    for key in ("access", "detail"):
        if isinstance(out.get(key), str):
            out[key] = json.loads(out[key])
    return out


class AllocationReader:
    """The query reads on one connection (service_layer/ports.py: `AllocationReads`)."""

    def __init__(self, conn: asyncpg.Connection) -> None:
        self.conn = conn

    async def find_allocations(
        self,
        *,
        allocation_id: uuid.UUID | None = None,
        tenant_id: str | None = None,
        state: str | None = None,
        node_id: str | None = None,
        allocation_ids: list[uuid.UUID] | None = None,
        limit: int = 100,
    ) -> list[dict[str, Any]]:
        """Allocations matching every filter given, newest first; at most `limit` + 1 rows, so the caller can
        tell that more matched."""
        rows = await self.conn.fetch(
            f"SELECT {_SUMMARY_COLUMNS} FROM allocations "
            "WHERE ($1::uuid IS NULL OR allocation_id = $1) AND ($2::text IS NULL OR tenant_id = $2) "
            "AND ($3::text IS NULL OR state = $3) AND ($4::text IS NULL OR node_id = $4) "
            "AND ($6::uuid[] IS NULL OR allocation_id = ANY($6::uuid[])) "
            "ORDER BY created_at DESC, allocation_id LIMIT $5",
            allocation_id,
            tenant_id,
            state,
            node_id,
            limit + 1,
            allocation_ids,
        )
        return [_decoded(r) for r in rows]

    async def timeline_of(self, allocation_id: uuid.UUID) -> list[dict[str, Any]]:
        rows = await self.conn.fetch(
            "SELECT seq, state, previous_state, reason_code, at, detail FROM allocation_timeline "
            "WHERE allocation_id = $1 ORDER BY seq",
            allocation_id,
        )
        return [_decoded(r) for r in rows]


def allocation_reads(pool: asyncpg.Pool) -> Callable[[], AbstractAsyncContextManager[AllocationReader]]:
    """A reader on a connection of `pool`, held for one answer (both its reads on one connection)."""

    @asynccontextmanager
    async def reading() -> AsyncIterator[AllocationReader]:
        async with pool.acquire() as conn:
            yield AllocationReader(conn)

    return reading
