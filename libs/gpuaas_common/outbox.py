"""Transactional outbox: events are rows written with the domain change, then relayed to JetStream.

The commit that writes the rows also NOTIFYs the relay, and the notification carries the rows themselves
(event id, aggregate, subject, body) when they fit in a NOTIFY payload. Postgres delivers notifications in
commit order, so the relay publishes what they carry without reading the table: one round trip less per
commit, the largest cost left in relaying at low load. It deletes what it published by event id, in batches.

The table stays the truth. The relay reads it (in id order, never `id > last_seen`: sequence values are
handed out before commit, so a slow transaction would be skipped) when it becomes leader, every poll
interval, when a notification carries no rows (too big, or an older writer), and after any failed publish
until a read finds the table drained. Per-aggregate order: one relay per schema holds an advisory lock; the
rows of one aggregate bound for one stream are published strictly one after the other, in commit order from
notifications and in id order from the table, and a failed publish holds back the later rows of its aggregate
on that stream (they wait in the table for the next read). Rows of one aggregate bound for different streams
(an allocation's lifecycle event and its node task) go out side by side: each durable consumer reads one
stream, so none can see their relative order (a plain subscription to both, an ops watcher's, may), and the
publishes share one write and one wake-up. A row published by both paths (committed while a read looked) is
published once: the relay remembers the event ids it published recently, and JetStream's duplicate window
(Nats-Msg-Id) and every consumer's inbox drop anything a dying relay left to its successor.

Only the service's own backends may tell the relay what to publish. Postgres checks no privilege on NOTIFY, so
each service has a database of its own (pg_roles), where no other service's role can connect; and, as a second
wall, the relay takes rows only from a notification whose sender is a connection of its own service's pool
(`writers`). Any other notification (another replica's pool, a superuser, a forgery) only wakes it to read the
table, which only the service's role can write: nothing it names is published from the payload itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import asyncpg
from nats.js import JetStreamContext
from prometheus_client import Counter, Histogram
from pydantic import BaseModel

from .bus_gate import TrafficGate
from .contract import Envelope, spec_for
from .db import CONNECTION_LOST, BackendPids, bytea_literal, check_schema, text_literal
from .jetstream import PUBACK_TIMEOUT_S, stream_of
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
    aggregate; a repeated event id is dropped, as the relay would. The NOTIFY is delivered at commit and
    carries the rows (`notice_payload`), or nothing when they do not fit: the relay then reads the table.
    Empty when nothing is pending."""
    if not pending:
        return ""
    bodies = [p.envelope.model_dump_json() for p in pending]
    rows = ", ".join(
        f"({text_literal(p.envelope.event_id)}, {text_literal(p.aggregate_id)}, {text_literal(p.subject)}, "
        f"{bytea_literal(body.encode())})"
        for p, body in zip(pending, bodies, strict=True)
    )
    notice = notice_payload(pending, bodies)
    return (
        f"INSERT INTO outbox (event_id, aggregate_id, subject, body) VALUES {rows} ON CONFLICT (event_id) DO NOTHING; "
        f"SELECT pg_notify({text_literal(notify_channel(schema))}, {text_literal(notice)})"
    )


# Postgres refuses a NOTIFY payload of 8000 bytes or more (and the transaction with it): leave room.
NOTICE_MAX_BYTES = 7800


def notice_payload(pending: list[PendingEvent], bodies: list[str]) -> str:
    """The rows as the relay publishes them, `{"t": raised at (epoch s), "rows": [[event id, aggregate id,
    subject, body], …]}`; "" when that is too big for a NOTIFY."""
    text = json.dumps(
        {
            "t": round(time.time(), 6),
            "rows": [[p.envelope.event_id, p.aggregate_id, p.subject, b] for p, b in zip(pending, bodies, strict=True)],
        },
        separators=(",", ":"),
    )
    return text if len(text.encode()) < NOTICE_MAX_BYTES else ""


@dataclass
class OutboxRow:
    """An outbox row as the relay publishes it, carried by a notification or read from the table."""

    event_id: str
    aggregate_id: str
    subject: str
    body: bytes
    raised_at: float


def parse_notice(payload: str) -> list[OutboxRow] | None:
    """The rows a notification carries; None when it carries none (or nothing this relay can read): read the
    table."""
    try:
        data = json.loads(payload)
        raised = float(data["t"])
        rows = [OutboxRow(str(e), str(a), str(s), str(b).encode(), raised) for e, a, s, b in data["rows"]]
    except (ValueError, TypeError, KeyError):
        return None
    return rows or None


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
        publish_timeout_s: float = PUBACK_TIMEOUT_S,
        max_backoff_s: float = 5.0,
        delete_grace_s: float = 0.05,
        recent_ids: int = 10_000,
        writers: BackendPids | None = None,
        gate: TrafficGate | None = None,
    ) -> None:
        """`writers`: the backends whose notifications may carry rows (the service's pool, `create_pool(writers=
        ...)`); None trusts no notification's rows, and every notification is a wake-up to read the table."""
        self.dsn = dsn
        self.schema = check_schema(schema)
        self.js = js
        # The connection's traffic gate (`Bus.gate`): a credential switch waits for the PubAcks in flight.
        self.gate = gate or TrafficGate()
        self.batch_size = batch_size
        self.poll_interval_s = poll_interval_s
        self.publish_timeout_s = publish_timeout_s
        self.max_backoff_s = max_backoff_s
        self.delete_grace_s = delete_grace_s
        self._wake = asyncio.Event()
        self._stopping = False
        self._leading = False
        self.published = 0
        self.reads = 0  # reads of the table (the notifications carry the rest)
        self._published: list[str] = []  # event ids published and not yet deleted
        self._published_since = 0.0  # monotonic time of the oldest of them
        self._notices: list[str] = []  # notification payloads not yet handled, in commit order
        self._clean = False  # the table was read and drained since leading began, and nothing failed since
        self._recent: OrderedDict[str, None] = OrderedDict()  # event ids published lately, oldest first
        self._recent_max = recent_ids
        self.writers = writers
        self.foreign_notices = 0  # notifications from a backend not in `writers`: read the table instead
        self._foreign_senders: set[int] = set()  # logged once each

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
            # One relay per schema keeps per-aggregate order (per stream) across replicas and restarts.
            while not self._stopping and not await lock_conn.fetchval(
                "SELECT pg_try_advisory_lock(hashtext($1))", f"gpuaas-relay:{self.schema}"
            ):
                await self._wait(self.poll_interval_s)
            # Listening before the first read: a row committed meanwhile is in the read or in a notification.
            self._notices.clear()
            self._clean = False
            await lock_conn.add_listener(notify_channel(self.schema), self._on_notify)
            self._leading = True
            log.info("relay_leader", schema=self.schema)
            backoff = 0.05
            last_read = time.monotonic()
            while not self._stopping:
                if lock_conn.is_closed():
                    raise ConnectionError("the connection holding the relay lock is closed")
                if not self._clean or time.monotonic() - last_read >= self.poll_interval_s:
                    # What the pending notifications name is committed: this read sees it.
                    self._notices.clear()
                    sent, failed = await self.drain_once(work_conn)
                    last_read = time.monotonic()
                    self._clean = not failed and sent < self.batch_size
                elif self._notices:
                    sent, failed = await self.relay_notices(work_conn)
                else:
                    sent, failed = 0, 0
                if failed:
                    self._clean = False
                    await self._wait(backoff)
                    backoff = min(backoff * 2, self.max_backoff_s)
                    continue
                backoff = 0.05
                # What was published is deleted by the next read, or in one batch once the oldest of it is
                # `delete_grace_s` old: a busy relay deletes a few times a second, not once per row.
                if self._published and time.monotonic() - self._published_since >= self.delete_grace_s:
                    await self.forget_published(work_conn)
                if self._notices or not self._clean:
                    continue  # more came meanwhile, or a full batch: more may be waiting
                if self._published:
                    due = self._published_since + self.delete_grace_s - time.monotonic()
                    if due > 0 and await self._wait(due):
                        continue
                    await self.forget_published(work_conn)
                    continue
                await self._wait(max(0.0, self.poll_interval_s - (time.monotonic() - last_read)))
            with contextlib.suppress(*CONNECTION_LOST):  # stopping: the next leader would only publish it again
                await self.forget_published(work_conn)
        finally:
            for conn in (lock_conn, work_conn):
                if conn is not None and not conn.is_closed():
                    conn.terminate()  # closing would wait on a server that may be gone

    def _on_notify(self, _conn: Any, pid: int, _channel: str, payload: str) -> None:
        if self.writers is None or pid not in self.writers:
            # What it carries is not ours to publish; an empty notice sends the relay to the table, in order
            # with the others (another replica's commit is there; a forgery is not).
            self.foreign_notices += 1
            if payload and pid not in self._foreign_senders and self.writers is not None:
                # Another replica's commits come this way too: named once per sender, not as an alarm.
                if len(self._foreign_senders) >= 4096:
                    self._foreign_senders.clear()
                self._foreign_senders.add(pid)
                log.info("relay_notice_not_from_own_pool", schema=self.schema, sender_pid=pid)
            payload = ""
        self._notices.append(payload)
        self._wake.set()

    async def _wait(self, seconds: float) -> bool:
        """Until woken (True: a NOTIFY, or stop) or `seconds` passed (False)."""
        if self._wake.is_set():
            self._wake.clear()
            return True
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

    async def relay_notices(self, conn: asyncpg.Connection) -> tuple[int, int]:
        """Publish the rows the pending notifications carry, without reading the table. A notification that
        carries none stops this: the table is read next, which covers it and everything after it."""
        self._wake.clear()
        # At most `batch_size` notifications at a time, as a read takes at most that many rows.
        notices, self._notices = self._notices[: self.batch_size], self._notices[self.batch_size :]
        rows: list[OutboxRow] = []
        for payload in notices:
            carried = parse_notice(payload)
            if carried is None:
                self._clean = False  # the table is read next: it has these rows and those of the later notices
                break
            rows.extend(r for r in carried if r.event_id not in self._recent)
        return await self._publish_rows(conn, rows)

    async def drain_once(self, conn: asyncpg.Connection) -> tuple[int, int]:
        """Delete what was published and not yet deleted, and publish the next batch read from the table. No
        transaction: only the leader reads or deletes (the advisory lock), and a row stays until its publish
        was acknowledged."""
        published = self._published
        self.reads += 1
        # In one statement the SELECT still sees the rows its DELETE removes: hence the second condition.
        rows = await conn.fetch(
            "WITH gone AS (DELETE FROM outbox WHERE event_id = ANY($1::text[])) "
            "SELECT id, event_id, aggregate_id, subject, body, created_at FROM outbox "
            "WHERE event_id <> ALL($1::text[]) ORDER BY id LIMIT $2",
            published,
            self.batch_size,
        )
        self._published = []
        return await self._publish_rows(
            conn,
            [
                OutboxRow(r["event_id"], r["aggregate_id"], r["subject"], bytes(r["body"]), r["created_at"].timestamp())
                for r in rows
            ],
        )

    async def _publish_rows(self, conn: asyncpg.Connection, rows: list[OutboxRow]) -> tuple[int, int]:
        """Publish `rows` (in the order given per aggregate and stream, those concurrently); (published, failed)."""
        if not rows:
            return 0, 0
        groups: OrderedDict[tuple[str, str], list[OutboxRow]] = OrderedDict()
        for row in rows:
            groups.setdefault((row.aggregate_id, stream_of(row.subject)), []).append(row)
        results = await self._publish_groups(list(groups.values()))
        failed = [(eid, err) for _, bad in results for eid, err in bad]
        await self._count_failures(conn, failed)
        ok = {eid for good, _ in results for eid in good}
        return self._done([r for r in rows if r.event_id in ok]), len(failed)

    async def _count_failures(self, conn: asyncpg.Connection, failed: list[tuple[str, str]]) -> None:
        """The failed row keeps its place in the table, with the attempt and the error counted for ops."""
        for event_id, err in failed:
            await conn.execute(
                "UPDATE outbox SET attempts = attempts + 1, last_error = $2 WHERE event_id = $1", event_id, err[:1000]
            )
        if failed:
            RELAY_ERRORS.labels(self.schema).inc(len(failed))

    def _done(self, rows: list[OutboxRow]) -> int:
        """Record what was published: to delete, to recognise if it comes again, and for the metrics."""
        if rows and not self._published:
            self._published_since = time.monotonic()
        now = time.time()
        for row in rows:
            self._published.append(row.event_id)
            self._recent[row.event_id] = None
            RELAY_LAG.labels(self.schema).observe(max(0.0, now - row.raised_at))
        while len(self._recent) > self._recent_max:
            self._recent.popitem(last=False)
        RELAYED.labels(self.schema).inc(len(rows))
        self.published += len(rows)
        return len(rows)

    async def forget_published(self, conn: asyncpg.Connection) -> None:
        """Delete what was published and not yet deleted (stopping, or idle): nothing to publish is read."""
        if self._published:
            await conn.execute("DELETE FROM outbox WHERE event_id = ANY($1::text[])", self._published)
            self._published = []

    async def _publish_groups(self, groups: list[list[OutboxRow]]) -> list[tuple[list[str], list[tuple[str, str]]]]:
        if len(groups) == 1:  # the common case at low load: no task to gather
            return [await self._publish_group(groups[0])]
        return list(await asyncio.gather(*(self._publish_group(g) for g in groups)))

    async def _publish_group(self, rows: list[OutboxRow]) -> tuple[list[str], list[tuple[str, str]]]:
        ok: list[str] = []
        for row in rows:
            try:
                async with self.gate.passage():
                    ack = await self.js.publish(
                        row.subject,
                        row.body,
                        timeout=self.publish_timeout_s,
                        headers={"Nats-Msg-Id": row.event_id},
                    )
                if not ack.stream:
                    raise RuntimeError("PubAck names no stream")
            except Exception as exc:  # any failure keeps this and later rows of the aggregate
                log.warning(
                    "relay_publish_failed",
                    schema=self.schema,
                    event_id=row.event_id,
                    subject=row.subject,
                    error=repr(exc),
                )
                # Later rows of the same aggregate wait, or they would overtake this one.
                return ok, [(row.event_id, repr(exc))]
            ok.append(row.event_id)
        return ok, []
