"""The console's login links used (migrations/006_login_links.sql): a link's nonce is recorded at its first use,
and a second use finds it there. The INSERT is the check, so it holds across ops-view replicas."""

from __future__ import annotations

import asyncpg

# Kept this long past a link's expiry before it is pruned: the signer's clock and the database's may differ.
PRUNE_AFTER = "1 hour"


async def spend(pool: asyncpg.Pool, nonce: str, expires_at: float) -> bool:
    """Record the link's nonce as used until `expires_at` (a UNIX time); True when this was its first use. Rows of
    links long expired go in the same transaction."""
    async with pool.acquire() as conn, conn.transaction():
        await conn.execute(f"DELETE FROM login_links_used WHERE expires_at < now() - interval '{PRUNE_AFTER}'")
        status = await conn.execute(
            "INSERT INTO login_links_used (nonce, expires_at) VALUES ($1, to_timestamp($2)) ON CONFLICT DO NOTHING",
            nonce,
            expires_at,
        )
    return status == "INSERT 0 1"
