"""Inventory and claims in Postgres: seeding, the capacity summary, index-ordered candidates,
node-locked SKIP LOCKED claims, slot transitions and release.

Locking protocol: every change to a node's slots or claims happens under that node's row lock
(`FOR UPDATE`). Placement takes it with SKIP LOCKED, so concurrent workers spread over the next
nodes in rank order instead of queueing on the best one; release, repair and admin changes wait for
it. The DB unique indexes on live claims are the last line of defence either way.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Iterable, Sequence
from typing import Any

import asyncpg

from gpuaas_common.fleet import Fleet

from ..domain.placement import (
    TIER_NUMA,
    TIER_SPAN,
    TIER_SWITCH,
    NodeCandidate,
    NodeFacts,
    Request,
    SlotView,
    summarize,
)
from ..domain.slots import incomplete_reason, movable_from
from .host_modes import record_created
from .slot_sql import ELIGIBLE_SLOT_SQL

SLOT_COLUMNS = (
    "slot_id, gpu_pci_address, nvme_by_id, fabric_vf_pci_address, mac, private_ip, ovs_bridge, numa_node, profile"
)
TAG_SLICE, TAG_BAREMETAL = "gpuaas-profile-slice-vm", "gpuaas-profile-baremetal"
# The simulated fleet's disks are generated empty and unmounted; real hosts report evidence through
# discovery and the admin API.
SIMULATED_CLEAN_DISK = {"mounted": False, "mounted_children": [], "signatures": [], "is_os_disk": False}

# A node may take slices now: intent, mode, readiness evidence, and no drain or maintenance.
SLICE_NODE_SQL = (
    "n.accepts_slices AND n.mode = 'slice' AND n.parity_failures = 0 AND n.schedulable AND NOT n.draining "
    "AND NOT n.maintenance"
)
# A node may be handed out whole: baremetal mode, intent, no drain or maintenance, and no approved slot
# left in any status but retired: a slot promises its GPU and disk to slices, a baremetal tenant owns
# them all.
BAREMETAL_NODE_SQL = (
    "n.accepts_baremetal AND n.mode = 'baremetal' AND n.schedulable AND NOT n.draining AND NOT n.maintenance "
    "AND NOT EXISTS (SELECT 1 FROM node_resource_slots s WHERE s.node_id = n.node_id AND s.status <> 'retired')"
)
# Slot states that count towards a node's capacity (approved, whether free or not).
COUNTED_SLOT_SQL = "status NOT IN ('disabled', 'retired')"
# A slot is free to claim: approved and complete (ELIGIBLE_SLOT_SQL) and no live claim on it, its
# fabric device or its disk.
FREE_SLOT_SQL = (
    f"{ELIGIBLE_SLOT_SQL} AND NOT EXISTS (SELECT 1 FROM allocation_resource_claims c "
    "WHERE c.node_id = s.node_id AND c.status <> 'released' AND (c.slot_id = s.slot_id "
    "OR (COALESCE(s.fabric_vf_pci_address, '') <> '' AND c.fabric_device = s.fabric_vf_pci_address) "
    "OR c.nvme_by_id = s.nvme_by_id))"
)


def image_ready_sql(slug: int, digest: int) -> str:
    """Node `n` holds the image verified with the requested digest, or no gate applies (the slug
    parameter is NULL). Parameter positions are the caller's: each query numbers its own."""
    return (
        f"(${slug}::text IS NULL OR EXISTS (SELECT 1 FROM node_image_readiness r WHERE r.node_id = n.node_id "
        f"AND r.slug = ${slug} AND r.status = 'verified' AND r.schedulable AND r.digest_sha256 = ${digest}::text))"
    )


def _gate(req_or_gate: Request | tuple[str, str] | None) -> tuple[str | None, str | None]:
    gate = req_or_gate.image_gate if isinstance(req_or_gate, Request) else req_or_gate
    return gate if gate is not None else (None, None)


NODE_SUMMARY_COLUMNS = "node_id, free_slots, total_slots, sliced, max_switch_free, numa_free, numa_capacity"


def _slot_view(r: asyncpg.Record) -> SlotView:
    return SlotView(r["slot_id"], r["numa_node"], r["pcie_switch"], r["fabric_vf_pci_address"])


def candidate_from_row(r: asyncpg.Record) -> NodeCandidate:
    return NodeCandidate(
        r["node_id"],
        r["free_slots"],
        r["total_slots"],
        1 if r["sliced"] else 0,
        r["max_switch_free"],
        tuple(r["numa_free"]),
        r["numa_capacity"],
    )


# --- seeding and the capacity summary --------------------------------------------------------------


async def seed_from_fleet(conn: asyncpg.Connection, fleet: Fleet) -> int:
    """Insert nodes and slots that are not there yet; never touches the status of existing rows."""
    added = 0
    created: list[str] = []
    for node in fleet.nodes:
        intent = "slice-vm" if node.kind == "slice_host" else "baremetal"
        # The simulated fleet is generated parity-clean; a real host's agent reports its own.
        inserted_node = await conn.fetchval(
            "INSERT INTO nodes (node_id, kind, hostname, region, pool, sku, maas_system_id, profile_intent, "
            "maas_tags, mode, parity_failures, parity_checked_at) "
            "VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, now()) ON CONFLICT (node_id) DO NOTHING "
            "RETURNING node_id",
            node.node_id,
            node.kind,
            node.hostname,
            node.region,
            node.pool,
            node.sku,
            node.maas_system_id,
            intent,
            [TAG_SLICE if node.kind == "slice_host" else TAG_BAREMETAL],
            "slice" if node.kind == "slice_host" else "baremetal",
            0 if node.kind == "slice_host" else None,
        )
        if inserted_node:
            created.append(inserted_node)
        rows = []
        for slot in node.slots:
            data = slot.model_dump()
            reason = incomplete_reason(data)
            rows.append(
                (
                    slot.slot_id,
                    node.node_id,
                    slot.gpu_pci_address,
                    slot.numa_node,
                    slot.pcie_switch,
                    slot.nvme_by_id,
                    slot.fabric_claim_mode,
                    slot.fabric_vf_pci_address,
                    slot.mac,
                    slot.private_ip,
                    slot.ovs_bridge,
                    slot.profile,
                    "disabled" if reason else "available",
                    reason,
                    json.dumps(SIMULATED_CLEAN_DISK),
                )
            )
        if rows:
            inserted = await conn.fetch(
                "INSERT INTO node_resource_slots (slot_id, node_id, gpu_pci_address, numa_node, pcie_switch, "
                "nvme_by_id, fabric_claim_mode, fabric_vf_pci_address, mac, private_ip, ovs_bridge, profile, "
                "status, status_reason, nvme_evidence, approved_by, approved_at) "
                "SELECT r.*, 'fleet-seed', now() FROM unnest($1::text[], $2::text[], $3::text[], $4::int[], "
                "$5::text[], $6::text[], $7::text[], $8::text[], $9::text[], $10::text[], $11::text[], $12::text[], "
                "$13::text[], $14::text[], $15::jsonb[]) AS r "
                "ON CONFLICT (slot_id) DO NOTHING RETURNING slot_id",
                *[list(col) for col in zip(*rows, strict=True)],
            )
            added += len(inserted)
    await record_created(conn, created, "fleet-seed", "mode from the fleet file's host kind")
    await refresh_nodes(conn, [n.node_id for n in fleet.nodes])
    return added


async def refresh_nodes(conn: asyncpg.Connection, node_ids: Iterable[str] | None = None) -> None:
    """Recompute the capacity summary of some nodes (all when None) from their slots and claims."""
    ids = sorted(set(node_ids)) if node_ids is not None else None
    nodes = await conn.fetch(
        "SELECT n.node_id, "
        f" (SELECT count(*) FROM node_resource_slots t WHERE t.node_id = n.node_id AND t.{COUNTED_SLOT_SQL}) AS total,"
        " (SELECT count(*) FROM allocation_resource_claims c WHERE c.node_id = n.node_id AND c.status <> 'released')"
        "   AS live_claims,"
        " (SELECT COALESCE(max(k), 0) FROM (SELECT count(*) AS k FROM node_resource_slots t WHERE t.node_id = n.node_id"
        f"   AND t.{COUNTED_SLOT_SQL} AND t.numa_node IS NOT NULL GROUP BY t.numa_node) q) AS numa_capacity "
        "FROM nodes n WHERE ($1::text[] IS NULL OR n.node_id = ANY($1::text[])) ORDER BY n.node_id",
        ids,
    )
    free = await conn.fetch(
        f"SELECT s.node_id, s.slot_id, s.numa_node, s.pcie_switch, s.fabric_vf_pci_address "
        f"FROM node_resource_slots s WHERE ($1::text[] IS NULL OR s.node_id = ANY($1::text[])) AND {FREE_SLOT_SQL}",
        ids,
    )
    by_node: dict[str, list[SlotView]] = {}
    for r in free:
        by_node.setdefault(r["node_id"], []).append(_slot_view(r))
    summaries = [
        summarize(n["node_id"], by_node.get(n["node_id"], []), n["total"], n["live_claims"], n["numa_capacity"])
        for n in nodes
    ]
    await conn.executemany(
        "UPDATE nodes SET free_slots = $2, total_slots = $3, sliced = $4, max_switch_free = $5, max_numa_free = $6, "
        "numa_free = $7, numa_capacity = $8 WHERE node_id = $1",
        [
            (
                c.node_id,
                c.free_slots,
                c.total_slots,
                c.sliced,
                c.max_switch_free,
                c.max_numa_free,
                list(c.numa_free),
                c.numa_capacity,
            )
            for c in summaries
        ],
    )


# --- candidates in rank order ----------------------------------------------------------------------

_TIER_SQL = {
    TIER_SWITCH: "n.max_switch_free >= $3",
    TIER_NUMA: "n.max_switch_free < $3 AND n.max_numa_free >= $3",
    TIER_SPAN: "n.max_numa_free < $3",
}


async def slice_candidates(
    conn: asyncpg.Connection, req: Request, classes: Sequence[tuple[bool, int]], page: int = 16
) -> AsyncIterator[NodeCandidate]:
    """Nodes in the documented score order, a page at a time, straight off the partial index."""
    for sliced, tier in classes:
        tier_sql = "TRUE" if req.gpus == 1 else _TIER_SQL[tier]
        after: tuple[int, str] = (-1, "")
        while True:
            rows = await conn.fetch(
                f"SELECT {NODE_SUMMARY_COLUMNS} FROM nodes n WHERE n.region = $1 AND n.sku = $2 AND {SLICE_NODE_SQL} "
                f"AND n.free_slots > 0 AND n.sliced = $4 AND n.free_slots >= $3 AND {tier_sql} "
                f"AND {image_ready_sql(8, 9)} "
                "AND (n.free_slots, n.node_id) > ($5, $6) ORDER BY n.sliced DESC, n.free_slots, n.node_id LIMIT $7",
                req.region,
                req.sku,
                req.gpus,
                sliced,
                after[0],
                after[1],
                page,
                *_gate(req),
            )
            for r in rows:
                yield candidate_from_row(r)
            if len(rows) < page:
                break
            after = (rows[-1]["free_slots"], rows[-1]["node_id"])


async def fleet_shape(conn: asyncpg.Connection) -> tuple[int | None, int | None, int | None]:
    """The largest number of approved slots behind one PCIe switch and on one NUMA node, fleet-wide."""
    row = await conn.fetchrow(
        f"SELECT (SELECT max(k) FROM (SELECT count(*) AS k FROM node_resource_slots WHERE {COUNTED_SLOT_SQL} "
        "  AND pcie_switch IS NOT NULL AND numa_node IS NOT NULL GROUP BY node_id, numa_node, pcie_switch) a) AS sw, "
        "(SELECT max(numa_capacity) FROM nodes WHERE total_slots > 0) AS max_numa, "
        "(SELECT min(numa_capacity) FROM nodes WHERE total_slots > 0) AS min_numa"
    )
    return row["sw"], row["max_numa"], row["min_numa"]


async def count_clean_nodes(conn: asyncpg.Connection, req: Request) -> int:
    return await conn.fetchval(
        f"SELECT count(*) FROM nodes n WHERE n.region = $1 AND n.sku = $2 AND {SLICE_NODE_SQL} AND NOT n.sliced "
        "AND n.free_slots > 0",
        req.region,
        req.sku,
    )


async def image_gate(conn: asyncpg.Connection, slug: str, digest: str) -> tuple[str, str] | None:
    """(slug, digest) when slice placement must require a verified cache of this image, else None.

    The rule: the gate applies to an image once any `image.node_cache_changed` for its slug has
    reached the scheduler. Images that predate the prewarm pipeline (the dev stack's seed images,
    copied into each host's cache by the fleet) are never reported, so they stay placeable as before.
    For a prewarmed image the rule is safe even before its reports arrive: the image pipeline
    activates an image only once every known slice host verified the catalog digest, so an
    allocation for it cannot be accepted while a host lacks it; the reports then keep placement
    honest afterwards (a host that loses the cache, a mismatch, a new digest, a host added later).
    """
    reported = await conn.fetchval("SELECT EXISTS (SELECT 1 FROM node_image_readiness WHERE slug = $1)", slug)
    return (slug, digest) if reported else None


LOCKED = object()


async def lock_slice_node(
    conn: asyncpg.Connection, node_id: str, *, wait: bool, image_gate: tuple[str, str] | None = None
) -> Any:
    """The node row under FOR UPDATE if it may still take slices (and, under an image gate, holds the
    image verified); LOCKED when another worker holds it."""
    skip = "" if wait else " SKIP LOCKED"
    row = await conn.fetchrow(
        f"SELECT n.node_id, n.total_slots, n.numa_capacity, {SLICE_NODE_SQL} AND {image_ready_sql(2, 3)} AS ok, "
        "EXISTS (SELECT 1 FROM allocation_resource_claims c WHERE c.node_id = n.node_id "
        "        AND c.claim_kind = 'node_exclusive' AND c.status <> 'released') AS exclusive "
        f"FROM nodes n WHERE n.node_id = $1 FOR UPDATE{skip}",
        node_id,
        *_gate(image_gate),
    )
    if row is None:
        exists = await conn.fetchval("SELECT 1 FROM nodes WHERE node_id = $1", node_id)
        return LOCKED if exists and not wait else None
    if not row["ok"] or row["exclusive"]:
        return None
    return row


async def free_slots_locked(conn: asyncpg.Connection, node_id: str) -> list[SlotView]:
    rows = await conn.fetch(
        f"SELECT s.slot_id, s.numa_node, s.pcie_switch, s.fabric_vf_pci_address FROM node_resource_slots s "
        f"WHERE s.node_id = $1 AND {FREE_SLOT_SQL} ORDER BY s.slot_id FOR UPDATE OF s SKIP LOCKED",
        node_id,
    )
    return [_slot_view(r) for r in rows]


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
        "SELECT m.*, (SELECT max(fencing_epoch) FROM ins) AS epoch FROM moved m ORDER BY m.slot_id",
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
    tier_sql = "TRUE" if req.gpus == 1 else _TIER_SQL[tier]
    rows = await conn.fetch(
        "WITH n AS (SELECT n.node_id, n.total_slots, n.numa_capacity FROM nodes n "
        f"  WHERE n.region = $1 AND n.sku = $2 AND {SLICE_NODE_SQL} AND n.free_slots > 0 AND n.sliced = $4 "
        f"  AND n.free_slots >= $3 AND {tier_sql} AND {image_ready_sql(5, 6)} "
        "  AND NOT EXISTS (SELECT 1 FROM allocation_resource_claims c WHERE c.node_id = n.node_id "
        "                  AND c.claim_kind = 'node_exclusive' AND c.status <> 'released') "
        "  ORDER BY n.sliced DESC, n.free_slots, n.node_id LIMIT 1 FOR UPDATE OF n SKIP LOCKED), "
        "free AS (SELECT s.slot_id, s.numa_node, s.pcie_switch, s.fabric_vf_pci_address FROM node_resource_slots s "
        f"  WHERE s.node_id = (SELECT node_id FROM n) AND {FREE_SLOT_SQL} FOR UPDATE OF s SKIP LOCKED) "
        "SELECT n.*, f.slot_id, f.numa_node, f.pcie_switch, f.fabric_vf_pci_address FROM n LEFT JOIN free f ON true "
        "ORDER BY f.slot_id",
        req.region,
        req.sku,
        req.gpus,
        sliced,
        *_gate(req),
    )
    if not rows:
        return None
    return rows[0], [_slot_view(r) for r in rows if r["slot_id"] is not None]


async def baremetal_candidates(conn: asyncpg.Connection, req: Request) -> list[str]:
    # Baremetal-only hosts first: a convertible host could go back to slices.
    rows = await conn.fetch(
        f"SELECT n.node_id FROM nodes n WHERE n.region = $1 AND n.sku = $2 AND {BAREMETAL_NODE_SQL} "
        "AND NOT EXISTS (SELECT 1 FROM allocation_resource_claims c "
        "WHERE c.node_id = n.node_id AND c.status <> 'released') "
        "ORDER BY n.accepts_slices, n.node_id",
        req.region,
        req.sku,
    )
    return [r["node_id"] for r in rows]


async def try_claim_baremetal(
    conn: asyncpg.Connection, node_id: str, allocation_id: uuid.UUID, tenant_id: str | None, *, wait: bool
) -> Any:
    skip = "" if wait else " SKIP LOCKED"
    node = await conn.fetchrow(
        f"SELECT n.node_id, n.maas_system_id, n.gpu_count FROM nodes n WHERE n.node_id = $1 AND {BAREMETAL_NODE_SQL} "
        f"FOR UPDATE{skip}",
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
    return {"node_id": node_id, "maas_system_id": node["maas_system_id"], "epoch": epoch}


# --- quota -------------------------------------------------------------------------------------------


async def prelude(conn: asyncpg.Connection, allocation_id: uuid.UUID, tenant_id: str) -> tuple[bool, int | None]:
    """Whether the allocation already holds claims, and the tenant's own quota, in one round trip."""
    row = await conn.fetchrow(
        "SELECT EXISTS (SELECT 1 FROM allocation_resource_claims WHERE allocation_id = $1) AS already, "
        "(SELECT max_gpus FROM tenant_quotas WHERE tenant_id = $2) AS max_gpus",
        allocation_id,
        tenant_id,
    )
    return row["already"], row["max_gpus"]


async def tenant_usage_locked(conn: asyncpg.Connection, tenant_id: str) -> int:
    # Serialises one tenant's placements so two concurrent claims cannot both pass the check.
    await conn.execute("SELECT pg_advisory_xact_lock(hashtext('gpuaas-quota:' || $1))", tenant_id)
    return await conn.fetchval(
        "SELECT COALESCE(sum(gpus), 0) FROM allocation_resource_claims WHERE tenant_id = $1 AND status <> 'released'",
        tenant_id,
    )


# --- why not -----------------------------------------------------------------------------------------


async def node_facts(conn: asyncpg.Connection, image_gate: tuple[str, str] | None = None) -> list[NodeFacts]:
    rows = await conn.fetch(
        f"SELECT n.*, {image_ready_sql(1, 2)} AS image_ready, "
        " (SELECT count(*) FROM allocation_resource_claims c WHERE c.node_id = n.node_id AND c.status <> 'released')"
        "   AS live_claims, "
        " EXISTS (SELECT 1 FROM allocation_resource_claims c WHERE c.node_id = n.node_id "
        "   AND c.claim_kind = 'node_exclusive' AND c.status <> 'released') AS exclusive_held, "
        " (SELECT count(*) FROM node_resource_slots s WHERE s.node_id = n.node_id AND s.status <> 'retired')"
        "   AS approved_slots "
        "FROM nodes n ORDER BY n.node_id",
        *_gate(image_gate),
    )
    return [
        NodeFacts(
            r["node_id"],
            r["region"],
            r["sku"],
            r["accepts_slices"],
            r["accepts_baremetal"],
            r["mode"],
            r["schedulable"],
            r["draining"],
            r["maintenance"],
            r["parity_failures"],
            r["live_claims"],
            r["exclusive_held"],
            NodeCandidate(
                r["node_id"],
                r["free_slots"],
                r["total_slots"],
                r["live_claims"],
                r["max_switch_free"],
                tuple(r["numa_free"]),
                r["numa_capacity"],
            ),
            r["image_ready"],
            r["approved_slots"],
        )
        for r in rows
    ]


# --- slot transitions and release --------------------------------------------------------------------


async def lock_nodes(conn: asyncpg.Connection, node_ids: Iterable[str]) -> None:
    """Wait for the row locks of these nodes, in id order so two lockers never deadlock."""
    ids = sorted(set(node_ids))
    if ids:
        await conn.fetch("SELECT node_id FROM nodes WHERE node_id = ANY($1::text[]) ORDER BY node_id FOR UPDATE", ids)


async def allocation_slots(conn: asyncpg.Connection, allocation_id: uuid.UUID) -> list[asyncpg.Record]:
    return await conn.fetch(
        "SELECT c.node_id, c.slot_id, c.claim_kind, s.status, s.nvme_by_id FROM allocation_resource_claims c "
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
        "WITH old AS (SELECT slot_id, status FROM node_resource_slots WHERE slot_id = ANY($1::text[]) "
        "  AND ($4::text[] IS NULL OR status = ANY($4::text[])) FOR UPDATE), "
        "moved AS (UPDATE node_resource_slots s SET status = $2, status_reason = $3, generation = s.generation + 1, "
        "  updated_at = now(), health_state = COALESCE($7, s.health_state), "
        "  health_detail = CASE WHEN $7::text IS NULL THEN s.health_detail ELSE $8 END "
        "  FROM old WHERE s.slot_id = old.slot_id RETURNING s.slot_id, s.node_id, old.status AS from_status), "
        "log AS (INSERT INTO slot_transitions (slot_id, from_status, to_status, reason, actor, allocation_id, detail) "
        "  SELECT slot_id, from_status, $2, $3, $5, $6, $9::jsonb FROM moved) "
        "SELECT * FROM moved ORDER BY slot_id",
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
    slots = [r["slot_id"] for r in await allocation_slots(conn, allocation_id) if r["slot_id"]]
    return len(
        await move_slots(conn, slots, status, reason, actor=actor, only_from=only_from, allocation_id=allocation_id)
    )


async def release_claims(conn: asyncpg.Connection, allocation_id: uuid.UUID) -> list[asyncpg.Record]:
    return await conn.fetch(
        "UPDATE allocation_resource_claims SET status = 'released', released_at = now() "
        "WHERE allocation_id = $1 AND status <> 'released' RETURNING node_id, slot_id, claim_kind",
        allocation_id,
    )
