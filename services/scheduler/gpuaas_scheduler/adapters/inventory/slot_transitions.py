"""Slot transitions (logged, guarded by domain/slots.py), node locks and drains, and claim release."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterable, Sequence

import asyncpg

from ...domain.slots import movable_from
from ..wipe_policy import effective_policy_sql, policy_site_sql


async def lock_nodes(conn: asyncpg.Connection, node_ids: Iterable[str]) -> None:
    """Wait for the row locks of these nodes, in id order so two lockers never deadlock."""
    ids = sorted(set(node_ids))
    if ids:
        await conn.fetch("SELECT node_id FROM nodes WHERE node_id = ANY($1::text[]) ORDER BY node_id FOR UPDATE", ids)


def allocation_lock_key(allocation_id: uuid.UUID | str) -> str:
    """The advisory lock's key text (`hashtext` of it): one definition for the handlers, whose bus takes it
    with the BEGIN (`UnitOfWork.lock_first`), and for everything else that locks an allocation."""
    return f"gpuaas-allocation:{allocation_id}"


async def lock_allocation(conn: asyncpg.Connection, allocation_id: uuid.UUID) -> None:
    """Serialise the messages about one allocation across scheduler replicas until the transaction ends.
    The scheduler keeps no allocation row to lock (its claims appear only once placed), so this is an
    advisory lock on the id; taken first, before any node lock, so it never closes a cycle with them."""
    await conn.execute("SELECT pg_advisory_xact_lock(hashtext($1))", allocation_lock_key(allocation_id))


async def allocation_slots(conn: asyncpg.Connection, allocation_id: uuid.UUID) -> list[asyncpg.Record]:
    return await conn.fetch(
        "SELECT c.node_id, c.slot_id, c.claim_kind, s.status, s.nvme_by_id, "
        f"{effective_policy_sql('s')} AS destructive_wipe_policy, {policy_site_sql('s')} AS wipe_policy_site "
        "FROM allocation_resource_claims c "
        "LEFT JOIN node_resource_slots s ON s.slot_id = c.slot_id "
        "WHERE c.allocation_id = $1 AND c.status <> 'released' ORDER BY c.slot_id",
        allocation_id,
    )


async def drain_node(conn: asyncpg.Connection, node_id: str, reason: str, *, actor: str) -> None:
    await conn.execute(
        "UPDATE nodes SET draining = true, drain_reason = $2, drained_by = $3, drained_at = now(), updated_at = now() "
        "WHERE node_id = $1",
        node_id,
        reason,
        actor,
    )


async def lock_clean_watermark(conn: asyncpg.Connection, region: str, sku: str) -> None:
    """Serialise decisions that may take a clean node in one region and SKU (held until commit)."""
    await conn.execute("SELECT pg_advisory_xact_lock(hashtext('gpuaas-clean:' || $1 || '/' || $2))", region, sku)


def _move_sql(which: str) -> str:
    """Move the slots `which` selects (a condition on $1) and log each transition, in one statement."""
    return (
        f"WITH old AS (SELECT slot_id, status FROM node_resource_slots WHERE {which} "
        "  AND ($4::text[] IS NULL OR status = ANY($4::text[])) FOR UPDATE), "
        "moved AS (UPDATE node_resource_slots s SET status = $2, status_reason = $3, generation = s.generation + 1, "
        "  updated_at = now(), health_state = COALESCE($7, s.health_state), "
        "  health_detail = CASE WHEN $7::text IS NULL THEN s.health_detail ELSE $8 END "
        "  FROM old WHERE s.slot_id = old.slot_id RETURNING s.slot_id, s.node_id, old.status AS from_status), "
        "log AS (INSERT INTO slot_transitions (slot_id, from_status, to_status, reason, actor, allocation_id, detail) "
        "  SELECT slot_id, from_status, $2, $3, $5, $6, $9::jsonb FROM moved) "
        "SELECT * FROM moved ORDER BY slot_id"
    )


_MOVE_SLOTS_SQL = _move_sql("slot_id = ANY($1::text[])")
# The slots of an allocation's live claims ($1 is its id): one round trip for the lifecycle moves.
_MOVE_ALLOCATION_SQL = _move_sql(
    "slot_id IN (SELECT c.slot_id FROM allocation_resource_claims c WHERE c.allocation_id = $1 "
    "AND c.status <> 'released' AND c.slot_id IS NOT NULL)"
)


async def move_slots(
    conn: asyncpg.Connection,
    slot_ids: Sequence[str],
    status: str,
    reason: str | None,
    *,
    actor: str,
    only_from: Sequence[str] | None = None,
    allocation_id: uuid.UUID | None = None,
    detail: dict | None = None,
    health: tuple[str, str | None] | None = None,
) -> list[asyncpg.Record]:
    """Move slots and log each transition (who, why, evidence) in the same statement."""
    if not slot_ids:
        return []
    # Only the moves domain/slots.py allows: a slot in any other status is left where it is.
    only_from = movable_from(status, only_from)
    rows = await conn.fetch(
        _MOVE_SLOTS_SQL,
        list(slot_ids),
        status,
        reason,
        list(only_from),
        actor,
        allocation_id,
        health[0] if health else None,
        health[1] if health else None,
        json.dumps(detail) if detail is not None else None,
    )
    return rows


async def set_slot_status(
    conn: asyncpg.Connection,
    allocation_id: uuid.UUID,
    status: str,
    reason: str | None = None,
    only_from: tuple[str, ...] | None = None,
    actor: str = "scheduler",
) -> int:
    """Move the slots held by an allocation's live claims."""
    rows = await conn.fetch(
        _MOVE_ALLOCATION_SQL,
        allocation_id,
        status,
        reason,
        list(movable_from(status, only_from)),
        actor,
        allocation_id,
        None,
        None,
        None,
    )
    return len(rows)


async def slots_reached(
    conn: asyncpg.Connection, allocation_id: uuid.UUID, slot_ids: Sequence[str], statuses: Sequence[str]
) -> set[str]:
    """Which of these slots the transition log shows in one of `statuses` under this allocation."""
    if not slot_ids:
        return set()
    rows = await conn.fetch(
        "SELECT DISTINCT slot_id FROM slot_transitions "
        "WHERE slot_id = ANY($1::text[]) AND allocation_id = $2 AND to_status = ANY($3::text[])",
        list(slot_ids),
        allocation_id,
        list(statuses),
    )
    return {r["slot_id"] for r in rows}


async def release_claims(conn: asyncpg.Connection, allocation_id: uuid.UUID) -> list[asyncpg.Record]:
    return await conn.fetch(
        "UPDATE allocation_resource_claims SET status = 'released', released_at = clock_timestamp() "
        "WHERE allocation_id = $1 AND status <> 'released' RETURNING node_id, slot_id, claim_kind",
        allocation_id,
    )
