"""The `admin_idempotency` table: one stored answer per Idempotency-Key, and the lock that makes requests
with one key run one at a time."""

from __future__ import annotations

import json
from typing import Any

import asyncpg


async def lock_key(conn: asyncpg.Connection, key: str) -> None:
    """Held until the transaction ends: the second request with this key waits, then replays or conflicts."""
    await conn.execute("SELECT pg_advisory_xact_lock(hashtext('gpuaas-admin-idem:' || $1))", key)


async def stored_answer(conn: asyncpg.Connection, key: str) -> asyncpg.Record | None:
    return await conn.fetchrow(
        "SELECT request_hash, method, path, status_code, response FROM admin_idempotency WHERE key = $1", key
    )


async def store_answer(
    conn: asyncpg.Connection,
    key: str,
    method: str,
    path: str,
    digest: str,
    status: int,
    payload: Any,
    request_id: str,
    actor: str,
) -> None:
    await conn.execute(
        "INSERT INTO admin_idempotency (key, method, path, request_hash, status_code, response, request_id, "
        "actor) VALUES ($1, $2, $3, $4, $5, $6::jsonb, $7, $8)",
        key,
        method,
        path,
        digest,
        status,
        json.dumps(payload),
        request_id,
        actor,
    )
