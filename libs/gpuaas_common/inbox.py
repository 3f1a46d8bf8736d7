"""Idempotent consumer: remember (consumer, message_id) in the same transaction as the effects."""

from __future__ import annotations

import asyncpg

from .db import text_literal


def claim_statement(consumer: str, message_id: str) -> str:
    """The claim as SQL text, so a unit of work can send it with its BEGIN in one round trip; its status
    is `INSERT 0 1` the first time and `INSERT 0 0` for a redelivery or a republish."""
    return (
        f"INSERT INTO inbox (consumer, message_id) VALUES ({text_literal(consumer)}, {text_literal(message_id)}) "
        "ON CONFLICT DO NOTHING"
    )


def claimed(status: str) -> bool:
    return status == "INSERT 0 1"


async def claim(conn: asyncpg.Connection, consumer: str, message_id: str) -> bool:
    """True the first time this consumer sees the message; False for a redelivery or a republish."""
    return claimed(await conn.execute(claim_statement(consumer, message_id)))
