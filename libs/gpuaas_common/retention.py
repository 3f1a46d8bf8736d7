"""Retention of the rows that exist only to make a repeat harmless: inbox rows and stored answers of
admin `Idempotency-Key`s. Without it both tables grow with every message and request, forever.

How long to keep them: an inbox row must outlive every way the same message can come back.
- JetStream drops a republished `Nats-Msg-Id` only within its 15-minute duplicate window;
- a consumer redelivers for max_deliver × (ack wait + back-off), minutes to tens of minutes;
- a durable that is deleted and re-created (`DeliverPolicy.ALL`) gets every message its stream still holds,
  and streams keep messages 7 days (`jetstream.StreamSpec.max_age_s`).
The last is the longest, so the default (`GPUAAS_INBOX_RETENTION_S`, 8 days) covers the stream age with a
day to spare; past it no copy of the message exists anywhere to be redelivered.

Rows a host's messages make (`HostRows`: drift reports, node tasks and phases, dead letters) are history, not
state, and a host decides how many there are: each such table is pruned by age (`GPUAAS_HOST_ROWS_RETENTION_S`)
and capped per host (`GPUAAS_HOST_ROWS_PER_NODE`, the newest kept; ops-view holds its cap at insert time too). A
group's newest row outlives the age, so a host that went quiet still shows its last report. A host-fed consumer's
inbox rows are capped per node as each is claimed (`inbox.HostInbox`); here they only age out like any inbox row.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

import asyncpg

from .cancellation import stop_if_cancelled
from .db import DB_UNAVAILABLE, check_schema
from .logging import get_logger

log = get_logger(__name__)

# (table, the column that says when the row was written)
INBOX = ("inbox", "received_at")
ADMIN_IDEMPOTENCY = ("admin_idempotency", "created_at")


@dataclass(frozen=True)
class HostRows:
    """A table a host's messages grow. `group`: the SQL expression naming the host a row belongs to (a column, or
    a lookup where the table names none); rows are capped per group, the newest kept. `at`: when it was written."""

    table: str
    at: str
    group: str


class RetentionSweeper:
    """Deletes expired rows of one schema in bounded batches, each its own short transaction, so a sweep
    never holds locks a handler waits on for long. Replicas share the work through an advisory lock: one
    sweeps, the others skip that round."""

    def __init__(
        self,
        pool: asyncpg.Pool,
        schema: str,
        *,
        inbox_retention_s: float,
        idempotency_retention_s: float,
        interval_s: float = 3600.0,
        batch_size: int = 5000,
        host_rows: Sequence[HostRows] = (),
        host_rows_retention_s: float = 30 * 24 * 3600.0,
        host_rows_per_node: int = 1000,
    ) -> None:
        self.pool = pool
        self.schema = check_schema(schema)
        self.retention_s = {INBOX: inbox_retention_s, ADMIN_IDEMPOTENCY: idempotency_retention_s}
        self.interval_s = interval_s
        self.batch_size = batch_size
        self.host_rows = tuple(host_rows)
        self.host_rows_retention_s = host_rows_retention_s
        self.host_rows_per_node = host_rows_per_node

    async def run(self) -> None:
        while True:
            stop_if_cancelled()
            try:
                await self.sweep()
            except DB_UNAVAILABLE as exc:
                # A missed round only delays retention; the next one catches up.
                log.warning("retention_sweep_failed", schema=self.schema, error=repr(exc))
            await asyncio.sleep(self.interval_s)

    async def sweep(self) -> dict[str, int] | None:
        """Rows deleted per table, or None when another replica holds the schema's sweep lock."""
        key = f"gpuaas-retention:{self.schema}"
        async with self.pool.acquire() as conn:
            if not await conn.fetchval("SELECT pg_try_advisory_lock(hashtext($1))", key):
                return None
            try:
                deleted: dict[str, int] = {}
                for (table, column), retention_s in self.retention_s.items():
                    # A service without the admin API has no admin_idempotency table.
                    if await conn.fetchval("SELECT to_regclass($1)", f'"{self.schema}"."{table}"') is None:
                        continue
                    deleted[table] = await self._sweep_table(conn, table, column, retention_s)
                for rows in self.host_rows:
                    deleted[rows.table] = deleted.get(rows.table, 0) + await self._sweep_host_rows(conn, rows)
                if any(deleted.values()):
                    log.info("retention_swept", schema=self.schema, **deleted)
                return deleted
            finally:
                await conn.execute("SELECT pg_advisory_unlock(hashtext($1))", key)

    async def _sweep_host_rows(self, conn: asyncpg.Connection, rows: HostRows) -> int:
        # The table and expressions are the services' own constants, never input.
        table = f'"{self.schema}"."{rows.table}"'
        sql = (
            f"DELETE FROM {table} WHERE ctid = ANY(ARRAY("
            f"SELECT ctid FROM (SELECT t.ctid, t.{rows.at} AS at, "
            f"row_number() OVER (PARTITION BY {rows.group} ORDER BY t.{rows.at} DESC) AS n FROM {table} t) r "
            f"WHERE n > $1 OR (n > 1 AND at < now() - make_interval(secs => $2)) LIMIT $3))"
        )
        total = 0
        while True:
            status = await conn.execute(
                sql, self.host_rows_per_node, float(self.host_rows_retention_s), self.batch_size
            )
            n = int(status.split()[-1])
            total += n
            if n < self.batch_size:
                return total

    async def _sweep_table(self, conn: asyncpg.Connection, table: str, column: str, retention_s: float) -> int:
        sql = (
            f'DELETE FROM "{self.schema}"."{table}" WHERE ctid = ANY(ARRAY('
            f'SELECT ctid FROM "{self.schema}"."{table}" '
            f"WHERE {column} < now() - make_interval(secs => $1) LIMIT $2))"
        )
        total = 0
        while True:
            status = await conn.execute(sql, float(retention_s), self.batch_size)
            n = int(status.split()[-1])
            total += n
            if n < self.batch_size:
                return total
