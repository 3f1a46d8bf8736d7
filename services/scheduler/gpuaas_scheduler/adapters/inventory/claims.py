"""Node-locked SKIP LOCKED claims of slots and of whole nodes, and the tenant quota checks around them."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import asyncpg

from gpuaas_common.contract import Shape

from ...domain.approval import DEFAULT_WIPE_POLICY
from ...domain.placement import NodeCandidate, Request, SlotView
from ..wipe_policy import effective_policy_sql
from .node_sql import BAREMETAL_NODE_SQL, SLICE_CANDIDATE, SLICE_LOCKED, rules_sql
from .predicates import (
    FREE_SLOT_SQL,
    SLOT_COLUMNS,
    SLOT_VIEW_COLUMNS,
    TIER_SQL,
    gate_params,
    hugepage_table,
    slot_view,
)

LOCKED = object()
_FREE_COLUMNS = ", ".join("s." + c.strip() for c in SLOT_VIEW_COLUMNS.split(","))
_FREE_COLUMNS_F = ", ".join("f." + c.strip() for c in SLOT_VIEW_COLUMNS.split(","))


# What a node the walk listed must still pass once locked (node_sql.SLICE_LOCKED).
_LOCKED_SQL = rules_sql(Shape.GPU_SLICE, SLICE_LOCKED, gpus=4, slug=2, digest=3, pages=5, driver=6)
# The fast path's rank-class walk: the candidate rules with the parameter numbers of its query.
_BEST_SQL = rules_sql(Shape.GPU_SLICE, SLICE_CANDIDATE, region=1, sku=2, gpus=3, slug=5, digest=6, pages=7, driver=8)


async def lock_slice_node(
    conn: asyncpg.Connection,
    node_id: str,
    *,
    wait: bool,
    gpus: int,
    image_gate: tuple[str, str] | None = None,
    driver_version: str | None = None,
) -> Any:
    """The node row under FOR UPDATE if it still passes the slice rules a listed node is checked against
    (node_sql.SLICE_LOCKED: in service, image, Fabric Manager, hugepages, not held whole); LOCKED when another
    worker holds it."""
    skip = "" if wait else " SKIP LOCKED"
    row = await conn.fetchrow(
        f"SELECT n.node_id, n.total_slots, n.numa_capacity, {_LOCKED_SQL} AS ok "
        f"FROM nodes n WHERE n.node_id = $1 FOR UPDATE{skip}",
        node_id,
        *gate_params(image_gate),
        gpus,
        hugepage_table(),
        driver_version,
    )
    if row is None:
        exists = await conn.fetchval("SELECT 1 FROM nodes WHERE node_id = $1", node_id)
        return LOCKED if exists and not wait else None
    if not row["ok"]:
        return None
    return row


async def free_slots_locked(conn: asyncpg.Connection, node_id: str) -> list[SlotView]:
    rows = await conn.fetch(
        f"SELECT {_FREE_COLUMNS} FROM node_resource_slots s "
        f"WHERE s.node_id = $1 AND {FREE_SLOT_SQL} ORDER BY s.slot_id FOR UPDATE OF s SKIP LOCKED",
        node_id,
    )
    return [slot_view(r) for r in rows]


async def claim_slots(
    conn: asyncpg.Connection,
    node_id: str,
    allocation_id: uuid.UUID,
    tenant_id: str | None,
    chosen: Sequence[SlotView],
    after: NodeCandidate,
) -> tuple[int, list[asyncpg.Record]]:
    """Claims, slot states and the node summary in one statement, under the node lock."""
    ids = [s.slot_id for s in chosen]
    rows = await conn.fetch(
        "WITH e AS (SELECT nextval('fencing_epoch_seq') AS epoch), "
        "moved AS (UPDATE node_resource_slots s SET status = 'reserved', status_reason = NULL, "
        "  generation = generation + 1, updated_at = now() WHERE s.slot_id = ANY($1::text[]) "
        f"  RETURNING {', '.join('s.' + c.strip() for c in SLOT_COLUMNS.split(','))}), "
        "ins AS (INSERT INTO allocation_resource_claims (allocation_id, node_id, slot_id, claim_kind, status, "
        "  fencing_epoch, tenant_id, gpus, fabric_device, nvme_by_id) "
        "  SELECT $2, $3, m.slot_id, 'slot', 'held', e.epoch, $4, 1, m.fabric_vf_pci_address, m.nvme_by_id "
        "  FROM moved m, e RETURNING fencing_epoch), "
        "summary AS (UPDATE nodes SET free_slots = $5, sliced = true, max_switch_free = $6, max_numa_free = $7, "
        "  numa_free = $8 WHERE node_id = $3) "
        "SELECT m.*, (SELECT max(fencing_epoch) FROM ins) AS epoch, "
        f"(SELECT {effective_policy_sql('ws')} FROM node_resource_slots ws WHERE ws.slot_id = m.slot_id) "
        "AS wipe_policy "
        "FROM moved m ORDER BY m.slot_id",
        ids,
        allocation_id,
        node_id,
        tenant_id,
        after.free_slots,
        after.max_switch_free,
        after.max_numa_free,
        list(after.numa_free),
    )
    if len(rows) != len(ids):
        raise RuntimeError(f"claimed {len(rows)} of {len(ids)} slots on {node_id}")
    return rows[0]["epoch"], rows


async def lock_best_in_class(
    conn: asyncpg.Connection, req: Request, sliced: bool, tier: int
) -> tuple[asyncpg.Record, list[SlotView]] | None:
    """The fast path: the first node of a rank class that nobody else holds, locked, with its free
    slots locked too, in one round trip. Postgres walks the rank index and skips locked rows, which
    is exactly "fall back to the next node if taken"."""
    tier_sql = "TRUE" if req.gpus == 1 else TIER_SQL[tier]
    rows = await conn.fetch(
        "WITH n AS (SELECT n.node_id, n.total_slots, n.numa_capacity FROM nodes n "
        f"  WHERE {_BEST_SQL} AND n.free_slots > 0 AND n.sliced = $4 AND {tier_sql} "
        "  ORDER BY n.sliced DESC, n.free_slots, n.node_id LIMIT 1 FOR UPDATE OF n SKIP LOCKED), "
        f"free AS (SELECT {_FREE_COLUMNS} FROM node_resource_slots s "
        f"  WHERE s.node_id = (SELECT node_id FROM n) AND {FREE_SLOT_SQL} FOR UPDATE OF s SKIP LOCKED) "
        f"SELECT n.*, {_FREE_COLUMNS_F} FROM n LEFT JOIN free f ON true "
        "ORDER BY f.slot_id",
        req.region,
        req.sku,
        req.gpus,
        sliced,
        *gate_params(req),
        hugepage_table(),
        req.driver_version,
    )
    if not rows:
        return None
    return rows[0], [slot_view(r) for r in rows if r["slot_id"] is not None]


async def try_claim_baremetal(
    conn: asyncpg.Connection, node_id: str, allocation_id: uuid.UUID, tenant_id: str | None, *, wait: bool
) -> Any:
    skip = "" if wait else " SKIP LOCKED"
    node = await conn.fetchrow(
        "SELECT n.node_id, n.maas_system_id, n.gpu_count, (SELECT sp.destructive_wipe_policy FROM site_wipe_policies "
        f"sp WHERE sp.region = n.region) AS wipe_policy FROM nodes n WHERE n.node_id = $1 AND {BAREMETAL_NODE_SQL} "
        f"FOR UPDATE OF n{skip}",
        node_id,
    )
    if node is None:
        if not wait and await conn.fetchval("SELECT 1 FROM nodes WHERE node_id = $1", node_id):
            return LOCKED
        return None
    busy = await conn.fetchval(
        "SELECT 1 FROM allocation_resource_claims WHERE node_id = $1 AND status <> 'released' LIMIT 1", node_id
    )
    if busy:
        return None
    epoch = await conn.fetchval(
        "INSERT INTO allocation_resource_claims (allocation_id, node_id, claim_kind, status, fencing_epoch, tenant_id, "
        "gpus) VALUES ($1, $2, 'node_exclusive', 'held', nextval('fencing_epoch_seq'), $3, $4) RETURNING fencing_epoch",
        allocation_id,
        node_id,
        tenant_id,
        node["gpu_count"],
    )
    await conn.execute("UPDATE nodes SET sliced = true WHERE node_id = $1", node_id)
    # The machine's MAAS erase at release follows the site's policy; a site that set none has the default, as its
    # slots do (domain/approval.py).
    return {
        "node_id": node_id,
        "maas_system_id": node["maas_system_id"],
        "epoch": epoch,
        "wipe_policy": node["wipe_policy"] or DEFAULT_WIPE_POLICY,
    }


# --- quota -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Prelude:
    already_placed: bool  # the allocation holds claims (any status): the answer was given before
    tenant_quota: int | None  # the tenant's own GPU quota, None when it has none
    image_reported: bool  # some host reported its cache of the image (see `domain.placement.request.image_gate`)


async def prelude(
    conn: asyncpg.Connection, allocation_id: uuid.UUID, tenant_id: str, image_slug: str | None
) -> Prelude:
    """What placement reads before it looks at any node, in one round trip."""
    row = await conn.fetchrow(
        "SELECT EXISTS (SELECT 1 FROM allocation_resource_claims WHERE allocation_id = $1) AS already, "
        "(SELECT max_gpus FROM tenant_quotas WHERE tenant_id = $2) AS max_gpus, "
        "$3::text IS NOT NULL AND EXISTS (SELECT 1 FROM node_image_readiness WHERE slug = $3) AS reported",
        allocation_id,
        tenant_id,
        image_slug,
    )
    return Prelude(row["already"], row["max_gpus"], row["reported"])


async def tenant_usage_locked(conn: asyncpg.Connection, tenant_id: str) -> int:
    # Serialises one tenant's placements so two concurrent claims cannot both pass the check.
    await conn.execute("SELECT pg_advisory_xact_lock(hashtext('gpuaas-quota:' || $1))", tenant_id)
    return await conn.fetchval(
        "SELECT COALESCE(sum(gpus), 0) FROM allocation_resource_claims WHERE tenant_id = $1 AND status <> 'released'",
        tenant_id,
    )
