"""Retention of the rows that exist only to make a repeat harmless: inbox rows and stored answers of
admin `Idempotency-Key`s. Without it both tables grow with every message and request, forever.

How long to keep them: an inbox row must outlive every way the same message can come back.
- JetStream drops a republished `Nats-Msg-Id` only within its 15-minute duplicate window;
- a consumer redelivers for max_deliver × (ack wait + back-off), minutes to tens of minutes;
- a durable that is deleted and re-created (`DeliverPolicy.ALL`) gets every message its stream still holds,
  and streams keep messages 7 days (`jetstream.StreamSpec.max_age_s`).
The last is the longest, so the default (`GPUAAS_INBOX_RETENTION_S`, 8 days) covers the stream age with a
day to spare; past it no copy of the message exists anywhere to be redelivered.
"""

from __future__ import annotations

import asyncio

import asyncpg

from .cancellation import stop_if_cancelled
from .db import DB_UNAVAILABLE, check_schema
from .logging import get_logger

log = get_logger(__name__)

# (table, the column that says when the row was written)
INBOX = ("inbox", "received_at")
ADMIN_IDEMPOTENCY = ("admin_idempotency", "created_at")


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
    ) -> None:
        self.pool = pool
        self.schema = check_schema(schema)
        self.retention_s = {INBOX: inbox_retention_s, ADMIN_IDEMPOTENCY: idempotency_retention_s}
        self.interval_s = interval_s
        self.batch_size = batch_size

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
                if any(deleted.values()):
                    log.info("retention_swept", schema=self.schema, **deleted)
                return deleted
            finally:
                await conn.execute("SELECT pg_advisory_unlock(hashtext($1))", key)

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
