"""Idempotent consumer: remember (consumer, message_id) in the same transaction as the effects."""

from __future__ import annotations

import asyncpg


async def claim(conn: asyncpg.Connection, consumer: str, message_id: str) -> bool:
    """True the first time this consumer sees the message; False for a redelivery or a republish."""
    row = await conn.fetchval(
        "INSERT INTO inbox (consumer, message_id) VALUES ($1, $2) ON CONFLICT DO NOTHING RETURNING 1",
        consumer,
        message_id,
    )
    return row is not None
