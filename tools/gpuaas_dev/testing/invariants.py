"""An independent checker: reads the databases and the streams directly (never through the services) and
lists every way the system disagrees with itself. Fuzzing and chaos runs end with it.

Each check returns human-readable violations; an empty list everywhere is the pass condition.
"""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import asyncpg
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from gpuaas_common.contract import Envelope
from gpuaas_common.contract.messages import DeadLetter

from .waiting import eventually

TERMINAL = ("released", "failed", "rejected", "unschedulable")
LIVE_SLOT_STATUSES = ("reserved", "provisioning", "active", "releasing")


async def database_violations(conn: asyncpg.Connection) -> list[str]:
    """Rows that contradict each other across the allocator's and the scheduler's schemas (superuser DSN)."""
    out: list[str] = []
    for row in await conn.fetch(
        "SELECT a.allocation_id, a.state, t.state AS last FROM allocator.allocations a "
        "LEFT JOIN LATERAL (SELECT state FROM allocator.allocation_timeline x WHERE x.allocation_id = a.allocation_id "
        "ORDER BY seq DESC LIMIT 1) t ON true WHERE t.state IS DISTINCT FROM a.state"
    ):
        out.append(f"allocation {row['allocation_id']} is {row['state']} but its timeline ends {row['last']}")
    for row in await conn.fetch(
        "SELECT a.allocation_id, a.shape, a.node_id FROM allocator.allocations a WHERE a.state = 'active' "
        "AND NOT EXISTS (SELECT 1 FROM scheduler.allocation_resource_claims c WHERE c.allocation_id = a.allocation_id "
        "AND c.status = 'held' AND c.node_id = a.node_id)"
    ):
        out.append(f"active allocation {row['allocation_id']} holds no claim on its node {row['node_id']}")
    for row in await conn.fetch(
        "SELECT c.allocation_id, a.state, count(*) AS n FROM scheduler.allocation_resource_claims c "
        "LEFT JOIN allocator.allocations a USING (allocation_id) WHERE c.status <> 'released' "
        "AND (a.allocation_id IS NULL OR a.state = ANY($1::text[])) GROUP BY 1, 2",
        [t for t in TERMINAL if t != "failed"],
    ):
        what = "an allocation the allocator does not know" if row["state"] is None else f"a {row['state']} allocation"
        out.append(f"{row['n']} live claim(s) held for {what}: {row['allocation_id']}")
    for row in await conn.fetch(
        "SELECT s.slot_id, s.status FROM scheduler.node_resource_slots s WHERE s.status = ANY($1::text[]) "
        "AND NOT EXISTS (SELECT 1 FROM scheduler.allocation_resource_claims c WHERE c.slot_id = s.slot_id "
        "AND c.status <> 'released')",
        list(LIVE_SLOT_STATUSES),
    ):
        out.append(f"slot {row['slot_id']} is {row['status']} with no live claim")
    for row in await conn.fetch(
        "SELECT s.slot_id FROM scheduler.node_resource_slots s WHERE s.status = 'available' AND EXISTS "
        "(SELECT 1 FROM scheduler.allocation_resource_claims c WHERE c.slot_id = s.slot_id AND c.status <> 'released')"
    ):
        out.append(f"slot {row['slot_id']} is available while a live claim holds it")
    out.extend(await double_booking(conn))
    for schema, n in (await outbox_backlog(conn)).items():
        if n:
            out.append(f"{n} event(s) still in {schema}'s outbox")
    return out


async def double_booking(conn: asyncpg.Connection) -> list[str]:
    """The history, not only the end state: no two claims on one slot (or two whole-node claims on one node)
    whose lifetimes overlap."""
    rows = await conn.fetch(
        "SELECT a.slot_id, a.node_id, a.allocation_id AS first, b.allocation_id AS second "
        "FROM scheduler.allocation_resource_claims a JOIN scheduler.allocation_resource_claims b "
        "ON a.claim_id < b.claim_id AND a.allocation_id <> b.allocation_id AND ("
        "  (a.slot_id IS NOT NULL AND a.slot_id = b.slot_id) OR "
        "  (a.claim_kind = 'node_exclusive' AND b.claim_kind = 'node_exclusive' AND a.node_id = b.node_id)) "
        "WHERE tstzrange(a.created_at, coalesce(a.released_at, 'infinity')) && "
        "      tstzrange(b.created_at, coalesce(b.released_at, 'infinity'))"
    )
    return [f"{r['slot_id'] or r['node_id']} was held by {r['first']} and {r['second']} at the same time" for r in rows]


async def outbox_backlog(conn: asyncpg.Connection) -> dict[str, int]:
    schemas = await conn.fetch("SELECT table_schema FROM information_schema.tables WHERE table_name = 'outbox'")
    return {
        r["table_schema"]: await conn.fetchval(f'SELECT count(*) FROM "{r["table_schema"]}".outbox') for r in schemas
    }


async def wait_consumers_drained(
    js: JetStreamContext, consumers: list[tuple[str, str]], timeout_s: float = 120.0
) -> dict[str, dict[str, int]]:
    """Wait until every durable has nothing pending or unacknowledged; returns the last figures (on timeout
    a durable that never drained shows non-zero numbers, one that vanished shows `missing`)."""
    figures: dict[str, dict[str, int]] = {}

    async def drained() -> bool:
        for stream, durable in consumers:
            try:
                info = await js.consumer_info(stream, durable)
            except NotFoundError:
                figures[durable] = {"missing": 1}
                continue
            figures[durable] = {"pending": info.num_pending or 0, "ack_pending": info.num_ack_pending or 0}
        return not any(any(f.values()) for f in figures.values())

    try:
        await eventually(drained, timeout=timeout_s, interval=0.25, what="durable consumers drained")
    except TimeoutError:
        pass
    return figures


async def dead_letters(js: JetStreamContext, after_seq: int = 0) -> tuple[list[dict[str, Any]], list[str]]:
    """Every message in the DLQ stream after `after_seq`, and what is wrong with any of them (not a valid
    dead letter, or one without a reason)."""
    info = await js.stream_info("DLQ")
    letters: list[dict[str, Any]] = []
    problems: list[str] = []
    first, last = max(info.state.first_seq, after_seq + 1), info.state.last_seq
    if not info.state.messages:
        return letters, problems
    for seq in range(first, last + 1):
        try:
            raw = await js.get_msg("DLQ", seq)
        except NotFoundError:
            continue
        try:
            env = Envelope.model_validate(json.loads(raw.data or b""))
            letter = DeadLetter.model_validate(env.payload)
        except ValueError as exc:
            problems.append(f"DLQ seq {seq} is not a valid dead letter: {str(exc)[:200]}")
            continue
        if not letter.reason.strip():
            problems.append(f"DLQ seq {seq} ({letter.consumer}) has no reason")
        letters.append(letter.model_dump(mode="json"))
    return letters, problems


def count_by(letters: list[dict[str, Any]], key: str) -> dict[str, int]:
    return dict(Counter(str(x[key]) for x in letters))
