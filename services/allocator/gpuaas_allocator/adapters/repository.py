"""Postgres access for allocations, their timeline and the known active images."""

from __future__ import annotations

import json
import uuid
from typing import Any

import asyncpg

from ..domain.model import ActiveImage


async def lock_allocation(conn: asyncpg.Connection, allocation_id: uuid.UUID) -> asyncpg.Record | None:
    return await conn.fetchrow("SELECT * FROM allocations WHERE allocation_id = $1 FOR UPDATE", allocation_id)


async def insert_allocation(conn: asyncpg.Connection, **fields: Any) -> None:
    cols = ", ".join(fields)
    params = ", ".join(f"${i}" for i in range(1, len(fields) + 1))
    values = [json.dumps(v) if isinstance(v, (dict, list)) else v for v in fields.values()]
    await conn.execute(f"INSERT INTO allocations ({cols}) VALUES ({params})", *values)


async def update_allocation(conn: asyncpg.Connection, allocation_id: uuid.UUID, **fields: Any) -> None:
    sets = ", ".join(f"{col} = ${i}" for i, col in enumerate(fields, start=2))
    values = [json.dumps(v) if isinstance(v, (dict, list)) else v for v in fields.values()]
    await conn.execute(
        f"UPDATE allocations SET {sets}, updated_at = now() WHERE allocation_id = $1", allocation_id, *values
    )


async def append_timeline(
    conn: asyncpg.Connection,
    allocation_id: uuid.UUID,
    state: str,
    previous_state: str | None,
    *,
    reason_code: str | None = None,
    detail: dict[str, Any] | None = None,
    cause_event_id: str | None = None,
) -> int:
    return await conn.fetchval(
        "INSERT INTO allocation_timeline (allocation_id, seq, state, previous_state, reason_code, detail, cause_event_id) "
        "SELECT $1, COALESCE(MAX(seq), 0) + 1, $2, $3, $4, $5, $6 FROM allocation_timeline WHERE allocation_id = $1 "
        "RETURNING seq",
        allocation_id, state, previous_state, reason_code, json.dumps(detail or {}), cause_event_id,
    )


async def get_image(conn: asyncpg.Connection, slug: str) -> ActiveImage | None:
    row = await conn.fetchrow("SELECT slug, kind, sku, digest_sha256, image_path FROM active_images WHERE slug = $1", slug)
    return ActiveImage(**dict(row)) if row else None


async def upsert_image(conn: asyncpg.Connection, image: ActiveImage) -> None:
    await conn.execute(
        "INSERT INTO active_images (slug, kind, sku, digest_sha256, image_path) VALUES ($1, $2, $3, $4, $5) "
        "ON CONFLICT (slug) DO UPDATE SET kind = EXCLUDED.kind, sku = EXCLUDED.sku, "
        "digest_sha256 = EXCLUDED.digest_sha256, image_path = EXCLUDED.image_path, updated_at = now()",
        image.slug, image.kind, image.sku, image.digest_sha256, image.image_path,
    )


async def delete_image(conn: asyncpg.Connection, slug: str) -> None:
    await conn.execute("DELETE FROM active_images WHERE slug = $1", slug)


async def count_images(pool: asyncpg.Pool) -> int:
    return await pool.fetchval("SELECT count(*) FROM active_images")
