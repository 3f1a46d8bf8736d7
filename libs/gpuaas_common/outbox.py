"""Transactional outbox: events are rows written with the domain change, then relayed to JetStream.

The relay reads the committed rows in id order (never `id > last_seen`: sequence values are handed
out before commit, so a slow transaction would be skipped), wakes on LISTEN/NOTIFY with polling as
the fallback, publishes with Nats-Msg-Id = event id, checks the PubAck, and keeps per-aggregate
order: one relay per schema holds an advisory lock, and within a batch the rows of one aggregate are
published strictly in id order while different aggregates go concurrently. Published rows are
deleted by the statement that reads the next batch: one round trip per batch. A relay that dies
between the publish and that statement leaves rows its successor publishes again, which JetStream's
duplicate window (Nats-Msg-Id) and every consumer's inbox drop.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import asyncpg
from nats.js import JetStreamContext
from prometheus_client import Counter, Histogram
from pydantic import BaseModel

from .contract import Envelope, spec_for
from .db import CONNECTION_LOST, bytea_literal, check_schema, text_literal
from .logging import get_logger

log = get_logger(__name__)

RELAYED = Counter("gpuaas_outbox_relayed_total", "Outbox rows published and deleted", ["schema"])
RELAY_ERRORS = Counter("gpuaas_outbox_publish_errors_total", "Failed outbox publishes", ["schema"])
RELAY_LAG = Histogram(
    "gpuaas_outbox_lag_seconds",
    "Commit-to-publish delay of outbox rows",
    ["schema"],
    buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)


def notify_channel(schema: str) -> str:
    return f"gpuaas_outbox_{check_schema(schema)}"


@dataclass
class PendingEvent:
    envelope: Envelope
    aggregate_id: str
    subject: str


@dataclass
class EventCollector:
    """Events raised during a unit of work; each gets its envelope (and event id) at once."""

    producer: str
    correlation_id: str | None = None
    causation_id: str | None = None
    pending: list[PendingEvent] = field(default_factory=list)

    async def add(
        self,
        type_: str,
        payload: BaseModel,
        *,
        aggregate_id: str,
        correlation_id: str | None = None,
        event_id: str | None = None,
        **subject_params: str,
    ) -> Envelope:
        """Async for the call sites' sake (they once wrote the row here); nothing is written before commit."""
        spec = spec_for(type_)
        if not isinstance(payload, spec.model):
            raise TypeError(f"{type_} needs a {spec.model.__name__} payload, got {type(payload).__name__}")
        envelope = Envelope.wrap(
            type_,
            payload.model_dump(mode="json"),
            producer=self.producer,
            correlation_id=correlation_id or self.correlation_id or aggregate_id,
            causation_id=self.causation_id,
            event_id=event_id,
        )
        self.pending.append(PendingEvent(envelope, aggregate_id, spec.subject(**subject_params)))
        return envelope

    def of_type(self, type_: str) -> list[Envelope]:
        return [p.envelope for p in self.pending if p.envelope.type == type_]


def pending_statement(schema: str, pending: list[PendingEvent]) -> str:
    """The rows and the NOTIFY as SQL text, so a unit of work sends them with its COMMIT in one round trip
    (`UnitOfWork.commit`). Rows get their ids in the order raised, which is the order the relay keeps per
    aggregate; a repeated event id is dropped, as the relay would. The NOTIFY is delivered at commit (Postgres
    folds repeats within a transaction); it only wakes the relay. Empty when nothing is pending."""
    if not pending:
        return ""
    rows = ", ".join(
        f"({text_literal(p.envelope.event_id)}, {text_literal(p.aggregate_id)}, {text_literal(p.subject)}, "
        f"{bytea_literal(p.envelope.model_dump_json().encode())})"
        for p in pending
    )
    return (
        f"INSERT INTO outbox (event_id, aggregate_id, subject, body) VALUES {rows} ON CONFLICT (event_id) DO NOTHING; "
        f"SELECT pg_notify({text_literal(notify_channel(schema))}, '')"
    )


async def write_pending(conn: asyncpg.Connection, schema: str, pending: list[PendingEvent]) -> None:
    """Insert the rows in the caller's transaction."""
    if pending:
        await conn.execute(pending_statement(schema, pending))


@dataclass
class OutboxWriter:
    """Writes each event at once into the caller's open transaction: for code that runs no unit of work
    (a service's start-up seeding, tests and benchmarks of the relay itself)."""

    conn: asyncpg.Connection
    schema: str
    producer: str
    correlation_id: str | None = None
    causation_id: str | None = None

    async def add(
        self,
        type_: str,
        payload: BaseModel,
        *,
        aggregate_id: str,
        correlation_id: str | None = None,
        event_id: str | None = None,
        **subject_params: str,
    ) -> Envelope:
        events = EventCollector(self.producer, self.correlation_id, self.causation_id)
        envelope = await events.add(
            type_,
            payload,
            aggregate_id=aggregate_id,
            correlation_id=correlation_id,
            event_id=event_id,
            **subject_params,
        )
        await write_pending(self.conn, self.schema, events.pending)
        return envelope


class OutboxRelay:
    def __init__(
        self,
        dsn: str,
        schema: str,
        js: JetStreamContext,
        *,
        batch_size: int = 200,
        poll_interval_s: float = 1.0,
        publish_timeout_s: float = 5.0,
        max_backoff_s: float = 5.0,
        delete_grace_s: float = 0.05,
    ) -> None:
        self.dsn = dsn
        self.schema = check_schema(schema)
        self.js = js
        self.batch_size = batch_size
        self.poll_interval_s = poll_interval_s
        self.publish_timeout_s = publish_timeout_s
        self.max_backoff_s = max_backoff_s
        self.delete_grace_s = delete_grace_s
        self._wake = asyncio.Event()
        self._stopping = False
        self._leading = False
        self.published = 0
        self._published: list[int] = []  # ids published and not yet deleted

    async def _connect(self) -> asyncpg.Connection:
        return await asyncpg.connect(self.dsn, server_settings={"search_path": self.schema})

    async def run(self) -> None:
        """Relay until stopped. A lost connection (Postgres restarted or failed over) ends the leadership with
        the advisory lock it held: the relay connects again and queues for the lock again, and never sends
        while another replica may be leader; it does not die (which would take the service with it)."""
        backoff = 0.05
        while not self._stopping:
            self._leading = False
            try:
                await self._lead()
            except CONNECTION_LOST as exc:
                log.warning("relay_db_lost", schema=self.schema, error=f"{type(exc).__name__}: {exc}"[:300])
                backoff = 0.05 if self._leading else min(backoff * 2, self.max_backoff_s)
                await self._wait(backoff)

    async def _lead(self) -> None:
        lock_conn: asyncpg.Connection | None = None
        work_conn: asyncpg.Connection | None = None
        try:
            lock_conn = await self._connect()
            work_conn = await self._connect()
            # One relay per schema keeps per-aggregate order across replicas and restarts.
            while not self._stopping and not await lock_conn.fetchval(
                "SELECT pg_try_advisory_lock(hashtext($1))", f"gpuaas-relay:{self.schema}"
            ):
                await self._wait(self.poll_interval_s)
            await lock_conn.add_listener(notify_channel(self.schema), self._on_notify)
            self._leading = True
            log.info("relay_leader", schema=self.schema)
            backoff = 0.05
            while not self._stopping:
                if lock_conn.is_closed():
                    raise ConnectionError("the connection holding the relay lock is closed")
                sent, failed = await self.drain_once(work_conn)
                if failed:
                    await self._wait(backoff)
                    backoff = min(backoff * 2, self.max_backoff_s)
                elif sent >= self.batch_size:
                    backoff = 0.05  # a full batch: more may be waiting
                else:
                    backoff = 0.05
                    # Drained: rows committed after our read looked have NOTIFYed (and set the wake-up) by now
                    # or will, so an immediate second look would only find nothing. What was just published
                    # is deleted by the next look, at no extra round trip, when one comes soon (under load);
                    # otherwise on its own, so published rows never linger as a backlog.
                    if sent:
                        if await self._wait(self.delete_grace_s):
                            continue
                        await self.forget_published(work_conn)
                    await self._wait(self.poll_interval_s)
            with contextlib.suppress(*CONNECTION_LOST):  # stopping: the next leader would only publish it again
                await self.forget_published(work_conn)
        finally:
            for conn in (lock_conn, work_conn):
                if conn is not None and not conn.is_closed():
                    conn.terminate()  # closing would wait on a server that may be gone

    def _on_notify(self, *_: Any) -> None:
        self._wake.set()

    async def _wait(self, seconds: float) -> bool:
        """Until woken (True: a NOTIFY, or stop) or `seconds` passed (False)."""
        try:
            await asyncio.wait_for(self._wake.wait(), timeout=seconds)
            woken = True
        except asyncio.TimeoutError:
            woken = False
        self._wake.clear()
        return woken

    def stop(self) -> None:
        self._stopping = True
        self._wake.set()

    async def drain_once(self, conn: asyncpg.Connection) -> tuple[int, int]:
        """Delete what the last call published, and publish the next batch. No transaction: only the leader
        reads or deletes (the advisory lock), and a row stays until its publish was acknowledged."""
        published = self._published
        # In one statement the SELECT still sees the rows its DELETE removes: hence the second condition.
        rows = await conn.fetch(
            "WITH gone AS (DELETE FROM outbox WHERE id = ANY($1::bigint[])) "
            "SELECT id, event_id, aggregate_id, subject, body, created_at FROM outbox "
            "WHERE id <> ALL($1::bigint[]) ORDER BY id LIMIT $2",
            published,
            self.batch_size,
        )
        self._published = []
        if not rows:
            return 0, 0
        groups: OrderedDict[str, list[asyncpg.Record]] = OrderedDict()
        for row in rows:
            groups.setdefault(row["aggregate_id"], []).append(row)
        results = await asyncio.gather(*(self._publish_group(g) for g in groups.values()))
        done = [i for ok_ids, _ in results for i in ok_ids]
        errors = [(i, err) for _, failed in results for i, err in failed]
        self._published = done
        for row_id, err in errors:
            await conn.execute(
                "UPDATE outbox SET attempts = attempts + 1, last_error = $2 WHERE id = $1", row_id, err[:1000]
            )
        now = time.time()
        done_ids = set(done)
        for row in rows:
            if row["id"] in done_ids:
                RELAY_LAG.labels(self.schema).observe(max(0.0, now - row["created_at"].timestamp()))
        RELAYED.labels(self.schema).inc(len(done))
        self.published += len(done)
        if errors:
            RELAY_ERRORS.labels(self.schema).inc(len(errors))
        return len(done), len(errors)

    async def forget_published(self, conn: asyncpg.Connection) -> None:
        """Delete what was published and not yet deleted (stopping, or idle): nothing to publish is read."""
        if self._published:
            await conn.execute("DELETE FROM outbox WHERE id = ANY($1::bigint[])", self._published)
            self._published = []

    async def _publish_group(self, rows: list[asyncpg.Record]) -> tuple[list[int], list[tuple[int, str]]]:
        ok: list[int] = []
        for row in rows:
            try:
                ack = await self.js.publish(
                    row["subject"],
                    bytes(row["body"]),
                    timeout=self.publish_timeout_s,
                    headers={"Nats-Msg-Id": row["event_id"]},
                )
                if not ack.stream:
                    raise RuntimeError("PubAck names no stream")
            except Exception as exc:  # any failure keeps this and later rows of the aggregate
                log.warning(
                    "relay_publish_failed",
                    schema=self.schema,
                    event_id=row["event_id"],
                    subject=row["subject"],
                    error=repr(exc),
                )
                # Later rows of the same aggregate wait, or they would overtake this one.
                return ok, [(row["id"], repr(exc))]
            ok.append(row["id"])
        return ok, []
