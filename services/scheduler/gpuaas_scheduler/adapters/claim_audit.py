"""The claim audit's SQL: which allocations are due to be checked with the allocator, stamped as they are taken."""

from __future__ import annotations

import uuid
from dataclasses import dataclass

import asyncpg


@dataclass(frozen=True)
class DueAllocation:
    allocation_id: uuid.UUID
    nodes: tuple[str, ...]
    claims_age_s: float


async def take_due(conn: asyncpg.Connection, *, every_s: float, min_age_s: float, limit: int) -> list[DueAllocation]:
    """Allocations holding live claims older than `min_age_s` and not audited in the last `every_s`, least recently
    audited first; their claims are stamped in the same statement. Transaction: the caller's, committed at once
    so that replicas running the audit at the same time take different allocations (rows another replica is
    stamping are skipped)."""
    rows = await conn.fetch(
        "WITH picked AS ("
        "  SELECT claim_id, allocation_id, node_id, created_at FROM allocation_resource_claims "
        "  WHERE status <> 'released' AND created_at < clock_timestamp() - make_interval(secs => $2) "
        "  AND (audited_at IS NULL OR audited_at < clock_timestamp() - make_interval(secs => $1)) "
        "  ORDER BY audited_at NULLS FIRST, claim_id LIMIT $3 FOR UPDATE SKIP LOCKED), "
        "stamped AS (UPDATE allocation_resource_claims c SET audited_at = clock_timestamp() FROM picked "
        "  WHERE c.claim_id = picked.claim_id RETURNING c.claim_id) "
        "SELECT allocation_id, array_agg(DISTINCT node_id ORDER BY node_id) AS nodes, "
        "  extract(epoch FROM clock_timestamp() - min(created_at))::float8 AS age_s "
        "FROM picked GROUP BY allocation_id ORDER BY allocation_id",
        every_s,
        min_age_s,
        limit,
    )
    return [DueAllocation(r["allocation_id"], tuple(r["nodes"]), r["age_s"]) for r in rows]
