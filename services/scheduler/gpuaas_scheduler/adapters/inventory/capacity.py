"""The capacity summary kept on each node row, and the fleet's shape (largest switch and NUMA groups)."""

from __future__ import annotations

from collections.abc import Iterable

import asyncpg

from ...domain.placement import SlotView, summarize
from .predicates import COUNTED_SLOT_SQL, FREE_SLOT_SQL, slot_view

_UPDATE_SUMMARY_SQL = (
    "UPDATE nodes SET free_slots = $2::integer, total_slots = $3::integer, sliced = $4::boolean, "
    "max_switch_free = $5::integer, max_numa_free = $6::integer, numa_free = $7::integer[], "
    "numa_capacity = $8::integer WHERE node_id = $1::text"
)


async def refresh_nodes(conn: asyncpg.Connection, node_ids: Iterable[str] | None = None) -> None:
    """Recompute the capacity summary of some nodes (all when None) from their slots and claims, in the
    caller's transaction: one read, then one pipelined round trip for the node rows."""
    ids = sorted(set(node_ids)) if node_ids is not None else None
    # One round trip: each node's counts (computed once per node, hence MATERIALIZED) with its free slots,
    # one row per free slot and a row of NULLs for a node without any.
    rows = await conn.fetch(
        "WITH n AS MATERIALIZED (SELECT n.node_id, "
        f" (SELECT count(*) FROM node_resource_slots t WHERE t.node_id = n.node_id AND t.{COUNTED_SLOT_SQL}) AS total,"
        " (SELECT count(*) FROM allocation_resource_claims c WHERE c.node_id = n.node_id AND c.status <> 'released')"
        "   AS live_claims,"
        " (SELECT COALESCE(max(k), 0) FROM (SELECT count(*) AS k FROM node_resource_slots t WHERE t.node_id = n.node_id"
        f"   AND t.{COUNTED_SLOT_SQL} AND t.numa_node IS NOT NULL GROUP BY t.numa_node) q) AS numa_capacity "
        "FROM nodes n WHERE ($1::text[] IS NULL OR n.node_id = ANY($1::text[]))) "
        "SELECT n.node_id, n.total, n.live_claims, n.numa_capacity, "
        "  f.slot_id, f.numa_node, f.pcie_switch, f.fabric_vf_pci_address, f.module_id "
        "FROM n LEFT JOIN LATERAL (SELECT s.slot_id, s.numa_node, s.pcie_switch, s.fabric_vf_pci_address, s.module_id "
        f"  FROM node_resource_slots s WHERE s.node_id = n.node_id AND {FREE_SLOT_SQL}) f ON true "
        "ORDER BY n.node_id",
        ids,
    )
    nodes: dict[str, asyncpg.Record] = {}
    by_node: dict[str, list[SlotView]] = {}
    for r in rows:
        nodes.setdefault(r["node_id"], r)
        if r["slot_id"] is not None:
            by_node.setdefault(r["node_id"], []).append(slot_view(r))
    summaries = [
        summarize(n["node_id"], by_node.get(n["node_id"], []), n["total"], n["live_claims"], n["numa_capacity"])
        for n in nodes.values()
    ]
    updates = [
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
    ]
    await conn.executemany(_UPDATE_SUMMARY_SQL, updates)


async def fleet_shape(conn: asyncpg.Connection) -> tuple[int | None, int | None, int | None]:
    """The largest number of approved slots behind one PCIe switch and on one NUMA node, fleet-wide. A host
    placed on NVLink partitions counts its pairs as switch groups (domain/placement/fit.py), whatever its PCIe
    layout."""
    row = await conn.fetchrow(
        f"SELECT (SELECT max(k) FROM (SELECT count(*) AS k FROM node_resource_slots WHERE {COUNTED_SLOT_SQL} "
        "  AND pcie_switch IS NOT NULL AND numa_node IS NOT NULL GROUP BY node_id, numa_node, pcie_switch "
        f"  UNION ALL SELECT 2 WHERE EXISTS (SELECT 1 FROM node_resource_slots WHERE {COUNTED_SLOT_SQL} "
        "  AND module_id IS NOT NULL)) a) AS sw, "
        "(SELECT max(numa_capacity) FROM nodes WHERE total_slots > 0) AS max_numa, "
        "(SELECT min(numa_capacity) FROM nodes WHERE total_slots > 0) AS min_numa"
    )
    return row["sw"], row["max_numa"], row["min_numa"]
