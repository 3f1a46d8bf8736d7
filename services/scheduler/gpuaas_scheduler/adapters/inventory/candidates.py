"""Candidate nodes in rank order for slices and for baremetal, the image gate, and the facts behind
"why not" answers."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Collection, Sequence

import asyncpg

from gpuaas_common.contract import Shape

from ...domain.placement import NodeCandidate, NodeFacts, Request, node_skus
from .node_sql import BAREMETAL_CANDIDATE, SLICE_CANDIDATE, SLICE_HOST, rules_sql
from .predicates import (
    MODULE_STATES_SQL,
    NODE_SUMMARY_COLUMNS,
    SLOT_DRIFT_SQL,
    TIER_SQL,
    UNCLAIMED_SLOT_SQL,
    candidate_from_row,
    gate_params,
    hugepage_profiles_sql,
    hugepage_table,
    hugepages_held_sql,
    hugepages_per_gpu_sql,
    image_ready_sql,
)

# The slice rules a candidate row passes (node_sql.SLICE_CANDIDATE), with the parameter numbers of the queries
# below and of `claims.lock_best_in_class`: region $1, SKU $2, GPUs $3, image gate $5/$6 (here $8/$9),
# hugepage table, driver version.
_CANDIDATE_SQL = rules_sql(
    Shape.GPU_SLICE, SLICE_CANDIDATE, region=1, sku=2, gpus=3, slug=8, digest=9, pages=10, driver=11
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
                f"SELECT {NODE_SUMMARY_COLUMNS} FROM nodes n WHERE {_CANDIDATE_SQL} "
                f"AND n.free_slots > 0 AND n.sliced = $4 AND {tier_sql} "
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


# The same rules with the parameter numbers of `missed_slice_candidates`: the nodes already seen are $4.
_MISSED_SQL = rules_sql(Shape.GPU_SLICE, SLICE_CANDIDATE, region=1, sku=2, gpus=3, slug=5, digest=6, pages=7, driver=8)


async def missed_slice_candidates(
    conn: asyncpg.Connection, req: Request, classes: Sequence[tuple[bool, int]], seen: Collection[str], page: int = 16
) -> list[NodeCandidate]:
    """Candidates not in `seen`, up to `page` of each of `classes`, in score order, read in one statement (one
    snapshot): none at all means no candidate of any class is unseen.

    `slice_candidates` reads a statement per class and page, each with a snapshot of its own, so a host can move
    past the reads: a clean host another placement slices meanwhile goes from a class not yet read into one
    already read, and is in no answer. After a walk of those answers, this finds what they missed: each class
    off its own index scan, as there, so what it costs grows with the hosts skipped, not the fleet."""
    branches = [
        f"(SELECT {rank} AS class_rank, {NODE_SUMMARY_COLUMNS} FROM nodes n WHERE {_MISSED_SQL} "
        f"AND n.free_slots > 0 AND n.sliced = {'true' if sliced else 'false'} "
        f"AND {'TRUE' if req.gpus == 1 else TIER_SQL[tier]} AND n.node_id NOT IN (SELECT unnest($4::text[])) "
        f"ORDER BY n.free_slots, n.node_id LIMIT {int(page)})"
        for rank, (sliced, tier) in enumerate(classes)
    ]
    rows = await conn.fetch(
        f"SELECT * FROM ({' UNION ALL '.join(branches)}) c ORDER BY class_rank, free_slots, node_id",
        req.region,
        req.sku,
        req.gpus,
        list(seen),
        *gate_params(req),
        hugepage_table(),
        req.driver_version,
    )
    return [candidate_from_row(r) for r in rows]


# A slice host in service in the request's region and SKU, whatever else the request asks.
_CLEAN_SQL = rules_sql(Shape.GPU_SLICE, ("region", "sku", *SLICE_HOST), region=1, sku=2)


async def count_clean_nodes(conn: asyncpg.Connection, req: Request) -> int:
    return await conn.fetchval(
        f"SELECT count(*) FROM nodes n WHERE {_CLEAN_SQL} AND NOT n.sliced AND n.free_slots > 0",
        req.region,
        req.sku,
    )


_BAREMETAL_SQL = rules_sql(Shape.BAREMETAL, BAREMETAL_CANDIDATE, region=1, skus=2)


async def baremetal_candidates(conn: asyncpg.Connection, req: Request) -> list[str]:
    # Baremetal-only hosts first: a convertible host could go back to slices.
    rows = await conn.fetch(
        f"SELECT n.node_id FROM nodes n WHERE {_BAREMETAL_SQL} ORDER BY n.accepts_slices, n.node_id",
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
