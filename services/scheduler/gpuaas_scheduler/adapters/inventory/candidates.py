"""Candidate nodes in rank order for slices and for baremetal, the image gate, and the facts behind
"why not" answers."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Sequence

import asyncpg

from ...domain.placement import NodeCandidate, NodeFacts, Request, node_skus
from .predicates import (
    BAREMETAL_NODE_SQL,
    MODULE_STATES_SQL,
    NODE_SUMMARY_COLUMNS,
    SLICE_NODE_SQL,
    SLOT_DRIFT_SQL,
    TIER_SQL,
    UNCLAIMED_SLOT_SQL,
    candidate_from_row,
    fabric_manager_ok_sql,
    gate_params,
    hugepage_profiles_sql,
    hugepage_table,
    hugepages_held_sql,
    hugepages_ok_sql,
    hugepages_per_gpu_sql,
    image_ready_sql,
)


async def slice_candidates(
    conn: asyncpg.Connection, req: Request, classes: Sequence[tuple[bool, int]], page: int = 16
) -> AsyncIterator[NodeCandidate]:
    """Nodes in the documented score order, a page at a time, straight off the partial index."""
    for sliced, tier in classes:
        tier_sql = "TRUE" if req.gpus == 1 else TIER_SQL[tier]
        after: tuple[int, str] = (-1, "")
        while True:
            rows = await conn.fetch(
                f"SELECT {NODE_SUMMARY_COLUMNS} FROM nodes n WHERE n.region = $1 AND n.sku = $2 AND {SLICE_NODE_SQL} "
                f"AND n.free_slots > 0 AND n.sliced = $4 AND n.free_slots >= $3 AND {tier_sql} "
                f"AND {image_ready_sql(8, 9)} AND {hugepages_ok_sql(3, 10)} AND {fabric_manager_ok_sql(11)} "
                "AND (n.free_slots, n.node_id) > ($5, $6) ORDER BY n.sliced DESC, n.free_slots, n.node_id LIMIT $7",
                req.region,
                req.sku,
                req.gpus,
                sliced,
                after[0],
                after[1],
                page,
                *gate_params(req),
                hugepage_table(),
                req.driver_version,
            )
            for r in rows:
                yield candidate_from_row(r)
            if len(rows) < page:
                break
            after = (rows[-1]["free_slots"], rows[-1]["node_id"])


async def count_clean_nodes(conn: asyncpg.Connection, req: Request) -> int:
    return await conn.fetchval(
        f"SELECT count(*) FROM nodes n WHERE n.region = $1 AND n.sku = $2 AND {SLICE_NODE_SQL} AND NOT n.sliced "
        "AND n.free_slots > 0",
        req.region,
        req.sku,
    )


async def baremetal_candidates(conn: asyncpg.Connection, req: Request) -> list[str]:
    # Baremetal-only hosts first: a convertible host could go back to slices.
    rows = await conn.fetch(
        f"SELECT n.node_id FROM nodes n WHERE n.region = $1 AND n.sku = ANY($2::text[]) AND {BAREMETAL_NODE_SQL} "
        "AND NOT EXISTS (SELECT 1 FROM allocation_resource_claims c "
        "WHERE c.node_id = n.node_id AND c.status <> 'released') "
        "ORDER BY n.accepts_slices, n.node_id",
        req.region,
        list(node_skus(req)),
    )
    return [r["node_id"] for r in rows]


# --- why not -----------------------------------------------------------------------------------------


async def node_facts(conn: asyncpg.Connection, image_gate: tuple[str, str] | None = None) -> list[NodeFacts]:
    rows = await conn.fetch(
        f"SELECT n.*, {image_ready_sql(1, 2)} AS image_ready, "
        f"{hugepages_held_sql(3)} AS hugepages_1g_held, {hugepages_per_gpu_sql(3)} AS hugepages_1g_per_gpu, "
        f"{hugepage_profiles_sql(3)} AS hugepage_profiles, "
        " (SELECT count(*) FROM allocation_resource_claims c WHERE c.node_id = n.node_id AND c.status <> 'released')"
        "   AS live_claims, "
        " EXISTS (SELECT 1 FROM allocation_resource_claims c WHERE c.node_id = n.node_id "
        "   AND c.claim_kind = 'node_exclusive' AND c.status <> 'released') AS exclusive_held, "
        " (SELECT count(*) FROM node_resource_slots s WHERE s.node_id = n.node_id AND s.status <> 'retired')"
        "   AS approved_slots, "
        f" (SELECT count(*) FROM node_resource_slots s WHERE s.node_id = n.node_id AND {UNCLAIMED_SLOT_SQL} "
        f"   AND {SLOT_DRIFT_SQL}) AS drifted_free_slots, "
        f" {MODULE_STATES_SQL} AS module_states "
        "FROM nodes n ORDER BY n.node_id",
        *gate_params(image_gate),
        hugepage_table(),
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
            r["preflight_status"],
            r["hugepages_1g_total"],
            r["hugepages_1g_held"],
            r["hugepages_1g_per_gpu"],
            drift_open=r["drift_open"],
            drifted_free_slots=r["drifted_free_slots"],
            hugepage_profiles=tuple((r["hugepage_profiles"] or "").split(",")) if r["hugepage_profiles"] else (),
            module_states=tuple((int(mid), str(state)) for mid, state in json.loads(r["module_states"] or "[]")),
            fabric_manager_version=r["fabric_manager_version"],
        )
        for r in rows
    ]
