"""The wipes asked of hosts and their outcomes (migrations/021_slot_wipes.sql): every statement on `slot_wipes`."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import asyncpg

from . import admin_nodes
from . import inventory as inv
from .admin_slots import CLAIMED
from .wipe_policy import effective_policy_sql, policy_site_sql


async def open_asks(
    conn: asyncpg.Connection,
    task_id: str,
    node_id: str,
    slots: Sequence[Mapping[str, Any]],
    *,
    cause: str,
    why: str,
    actor: str,
) -> None:
    """Record one ask per slot (`slot_id`, `nvme_by_id`, `wipe_policy`); an older open ask of a slot is superseded
    first, so only the newest task's report can free it."""
    ids = [s["slot_id"] for s in slots]
    await conn.execute(
        "UPDATE slot_wipes SET closed_at = now(), outcome = 'superseded', verdict = $2 "
        "WHERE slot_id = ANY($1::text[]) AND closed_at IS NULL",
        ids,
        f"superseded by wipe task {task_id}",
    )
    await conn.executemany(
        "INSERT INTO slot_wipes (task_id, slot_id, node_id, device, policy, cause, why, requested_by) "
        "VALUES ($1, $2, $3, $4, $5, $6, $7, $8)",
        [(task_id, s["slot_id"], node_id, s["nvme_by_id"], s["wipe_policy"], cause, why[:2000], actor) for s in slots],
    )


async def open_slot_ids(conn: asyncpg.Connection, slot_ids: Sequence[str]) -> set[str]:
    rows = await conn.fetch(
        "SELECT slot_id FROM slot_wipes WHERE slot_id = ANY($1::text[]) AND closed_at IS NULL", list(slot_ids)
    )
    return {r["slot_id"] for r in rows}


async def open_asks_of_task(conn: asyncpg.Connection, node_id: str, task_id: str) -> list[asyncpg.Record]:
    """The task's open asks on this node, each with its slot as it is now (locked: the caller holds the node's
    lock too) and the slot's effective wipe policy."""
    return await conn.fetch(
        "SELECT w.task_id, w.slot_id, w.device, w.policy, w.cause, s.status, s.nvme_by_id, s.node_id, "
        "s.gpu_pci_address, s.mac, s.private_ip, s.fabric_claim_mode, s.fabric_vf_pci_address, s.emulated, "
        f"{effective_policy_sql('s')} AS destructive_wipe_policy, {policy_site_sql('s')} AS wipe_policy_site, "
        f"{CLAIMED} "
        "FROM slot_wipes w JOIN node_resource_slots s ON s.slot_id = w.slot_id "
        "WHERE w.task_id = $1 AND w.node_id = $2 AND s.node_id = $2 AND w.closed_at IS NULL "
        "ORDER BY w.slot_id FOR UPDATE OF w, s",
        task_id,
        node_id,
    )


async def close(
    conn: asyncpg.Connection, task_id: str, slot_id: str, *, outcome: str, verdict: str, report: Mapping[str, Any]
) -> None:
    await conn.execute(
        "UPDATE slot_wipes SET closed_at = now(), outcome = $3, verdict = $4, report = $5::jsonb "
        "WHERE task_id = $1 AND slot_id = $2 AND closed_at IS NULL",
        task_id,
        slot_id,
        outcome,
        verdict[:2000],
        json.dumps(dict(report)),
    )


async def of_slot(conn: asyncpg.Connection, slot_id: str, limit: int = 20) -> list[asyncpg.Record]:
    """The slot's wipe asks, newest first: what ops read beside its transitions."""
    return await conn.fetch(
        "SELECT task_id, device, policy, cause, why, requested_by, requested_at, closed_at, outcome, verdict, report "
        "FROM slot_wipes WHERE slot_id = $1 ORDER BY requested_at DESC, task_id LIMIT $2",
        slot_id,
        limit,
    )


async def lock_overdue(
    conn: asyncpg.Connection, older_than_s: float, statuses: Sequence[str], limit: int
) -> list[asyncpg.Record]:
    """Open asks older than `older_than_s` of unclaimed slots in `statuses`, in node order, with the slot's
    disk and effective policy now; locked with their node and slot, skipping nodes another transaction holds (a
    report being judged, another replica's sweep)."""
    return await conn.fetch(
        "SELECT w.task_id, w.slot_id, w.node_id, w.cause, s.status, s.nvme_by_id, "
        f"{effective_policy_sql('s')} AS wipe_policy "
        "FROM slot_wipes w JOIN node_resource_slots s ON s.slot_id = w.slot_id AND s.node_id = w.node_id "
        "JOIN nodes n ON n.node_id = w.node_id "
        "WHERE w.closed_at IS NULL AND w.requested_at < now() - make_interval(secs => $1) "
        "AND s.status = ANY($2::text[]) AND NOT EXISTS (SELECT 1 FROM allocation_resource_claims c "
        "  WHERE c.slot_id = s.slot_id AND c.status <> 'released') "
        "ORDER BY w.node_id, w.slot_id LIMIT $3 FOR UPDATE OF n, w, s SKIP LOCKED",
        older_than_s,
        list(statuses),
        limit,
    )


async def expire(conn: asyncpg.Connection, task_id: str, slot_ids: Sequence[str], verdict: str) -> None:
    await conn.execute(
        "UPDATE slot_wipes SET closed_at = now(), outcome = 'expired', verdict = $3 "
        "WHERE task_id = $1 AND slot_id = ANY($2::text[]) AND closed_at IS NULL",
        task_id,
        list(slot_ids),
        verdict[:2000],
    )


class SlotWipeRepository:
    """The wipes asked of hosts, and the slot moves their outcomes call for (one guarded, logged statement each)."""

    def __init__(self, conn: asyncpg.Connection) -> None:
        self.conn = conn

    async def lock_node(self, node_id: str) -> bool:
        """The node's row lock; False: no such node."""
        return await admin_nodes.lock_node(self.conn, node_id) is not None

    async def open_asks(
        self, task_id: str, node_id: str, slots: Sequence[Mapping[str, Any]], *, cause: str, why: str, actor: str
    ) -> None:
        await open_asks(self.conn, task_id, node_id, slots, cause=cause, why=why, actor=actor)

    async def open_asks_of_task(self, node_id: str, task_id: str) -> list[dict[str, Any]]:
        return [dict(r) for r in await open_asks_of_task(self.conn, node_id, task_id)]

    async def close(self, task_id: str, slot_id: str, *, outcome: str, verdict: str, report: Mapping[str, Any]) -> None:
        await close(self.conn, task_id, slot_id, outcome=outcome, verdict=verdict, report=report)

    async def lock_overdue(self, older_than_s: float, statuses: Sequence[str], limit: int) -> list[dict[str, Any]]:
        return [dict(r) for r in await lock_overdue(self.conn, older_than_s, statuses, limit)]

    async def expire(self, task_id: str, slot_ids: Sequence[str], verdict: str) -> None:
        await expire(self.conn, task_id, slot_ids, verdict)

    async def move_slot(
        self,
        slot_id: str,
        to: str,
        reason: str | None,
        *,
        actor: str,
        only_from: Sequence[str],
        detail: dict[str, Any],
        health: tuple[str, str] | None,
    ) -> None:
        await inv.move_slots(
            self.conn, [slot_id], to, reason, actor=actor, only_from=list(only_from), detail=detail, health=health
        )
