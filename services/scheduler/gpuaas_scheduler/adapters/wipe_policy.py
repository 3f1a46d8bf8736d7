"""Site wipe policies (migrations/011_site_wipe_policy.sql): read, set, and the SQL of a slot's effective policy.

A slot's effective policy is its site's when the site has one, else the one recorded at its approval; placement
hands it to the agent (SlotBinding.wipe_policy) and release judges the agent's proof against it."""

from __future__ import annotations

import asyncpg


def effective_policy_sql(slot: str) -> str:
    """The effective wipe policy of the slot row aliased `slot` (a scalar subquery: one row per slot)."""
    return (
        "COALESCE((SELECT sp.destructive_wipe_policy FROM site_wipe_policies sp JOIN nodes wn ON wn.region = sp.region "
        f"WHERE wn.node_id = {slot}.node_id), {slot}.destructive_wipe_policy)"
    )


def policy_site_sql(slot: str) -> str:
    """The region whose site policy governs the slot row aliased `slot`, NULL when none does."""
    return (
        "(SELECT sp.region FROM site_wipe_policies sp JOIN nodes wn ON wn.region = sp.region "
        f"WHERE wn.node_id = {slot}.node_id)"
    )


async def site_policy(conn: asyncpg.Connection, region: str) -> asyncpg.Record | None:
    return await conn.fetchrow(
        "SELECT region, destructive_wipe_policy, set_by, reason, updated_at FROM site_wipe_policies WHERE region = $1",
        region,
    )


async def node_region(conn: asyncpg.Connection, node_id: str) -> str | None:
    return await conn.fetchval("SELECT region FROM nodes WHERE node_id = $1", node_id)


async def set_site_policy(conn: asyncpg.Connection, region: str, policy: str, *, actor: str, reason: str) -> list[str]:
    """Upsert the site's policy and record it on every slot of the region (so slot views say what release will
    demand); returns the slots whose recorded policy changed. Callers hold the region's nodes locked."""
    await conn.execute(
        "INSERT INTO site_wipe_policies (region, destructive_wipe_policy, set_by, reason) VALUES ($1, $2, $3, $4) "
        "ON CONFLICT (region) DO UPDATE SET destructive_wipe_policy = EXCLUDED.destructive_wipe_policy, "
        "set_by = EXCLUDED.set_by, reason = EXCLUDED.reason, updated_at = now()",
        region,
        policy,
        actor,
        reason,
    )
    rows = await conn.fetch(
        "UPDATE node_resource_slots s SET destructive_wipe_policy = $2, updated_at = now() FROM nodes n "
        "WHERE n.node_id = s.node_id AND n.region = $1 AND s.destructive_wipe_policy <> $2 RETURNING s.slot_id",
        region,
        policy,
    )
    return sorted(r["slot_id"] for r in rows)


async def lock_region_nodes(conn: asyncpg.Connection, region: str) -> list[str]:
    """The region's node locks, in id order (inventory's locking protocol), so no release judges a proof
    against a policy that is changing under it."""
    rows = await conn.fetch("SELECT node_id FROM nodes WHERE region = $1 ORDER BY node_id FOR UPDATE", region)
    return [r["node_id"] for r in rows]


async def claimed_slots(conn: asyncpg.Connection, slot_ids: list[str]) -> list[str]:
    """Those of the slots a live claim holds."""
    rows = await conn.fetch(
        "SELECT DISTINCT slot_id FROM allocation_resource_claims WHERE slot_id = ANY($1::text[]) "
        "AND status <> 'released' ORDER BY slot_id",
        slot_ids,
    )
    return [r["slot_id"] for r in rows]


async def slot_policy(conn: asyncpg.Connection, slot_id: str) -> asyncpg.Record | None:
    """The slot's effective wipe policy and the site that set it (NULL when its approval did)."""
    return await conn.fetchrow(
        f"SELECT {effective_policy_sql('s')} AS destructive_wipe_policy, {policy_site_sql('s')} AS wipe_policy_site "
        "FROM node_resource_slots s WHERE s.slot_id = $1",
        slot_id,
    )
