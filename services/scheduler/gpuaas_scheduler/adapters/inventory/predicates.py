"""The SQL fragments inventory queries share (which slots count and which are free, the image readiness gate,
the hugepage capacity, the rank tiers) and the row mappers. Which nodes may take a request is the node rules'
SQL (node_sql.py), built on these."""

from __future__ import annotations

import json

import asyncpg

from gpuaas_common.profiles import hugepage_profiles

from ...domain.placement import TIER_NUMA, TIER_SPAN, TIER_SWITCH, NodeCandidate, Request, SlotView
from ..slot_sql import ELIGIBLE_SLOT_SQL

# A parameter's number in the query, or `{name}` in a node rule's template (node_sql.py).
Param = int | str

SLOT_COLUMNS = (
    "slot_id, gpu_pci_address, nvme_by_id, fabric_vf_pci_address, mac, private_ip, ovs_bridge, numa_node, profile, "
    "module_id"
)
# What placement reads of a free slot (`slot_view`).
SLOT_VIEW_COLUMNS = "slot_id, numa_node, pcie_switch, fabric_vf_pci_address, module_id"

# Slot states that count towards a node's capacity (approved, whether free or not).
COUNTED_SLOT_SQL = "status NOT IN ('disabled', 'retired')"
# A slot is unclaimed: approved and complete (ELIGIBLE_SLOT_SQL) and no live claim on it, its fabric
# device or its disk.
UNCLAIMED_SLOT_SQL = (
    f"{ELIGIBLE_SLOT_SQL} AND NOT EXISTS (SELECT 1 FROM allocation_resource_claims c "
    "WHERE c.node_id = s.node_id AND c.status <> 'released' AND (c.slot_id = s.slot_id "
    "OR (COALESCE(s.fabric_vf_pci_address, '') <> '' AND c.fabric_device = s.fabric_vf_pci_address) "
    "OR c.nvme_by_id = s.nvme_by_id))"
)
# Open drift the node agent reported on the slot (acknowledged or resolved drift no longer counts).
SLOT_DRIFT_SQL = "EXISTS (SELECT 1 FROM node_drift d WHERE d.slot_id = s.slot_id AND d.status = 'open')"
# A slot is free to claim: unclaimed and no open drift on it.
FREE_SLOT_SQL = f"{UNCLAIMED_SLOT_SQL} AND NOT {SLOT_DRIFT_SQL}"
# Node `n`'s GPU slots with a module ID as JSON [[module, state], ...] (NULL: none), `domain.placement.NodeFacts`'s
# `module_states`: free to claim, held by a tenant (a live claim, or a status on the way to or back from one),
# or sick (anything else keeping it from placement: unhealthy, disabled, drifted, awaiting a verified wipe).
MODULE_STATES_SQL = (
    "(SELECT json_agg(json_build_array(s.module_id, CASE "
    f"WHEN {FREE_SLOT_SQL} THEN 'free' "
    "WHEN s.status IN ('reserved', 'provisioning', 'active', 'releasing', 'cleanup') OR EXISTS (SELECT 1 FROM "
    "allocation_resource_claims mc WHERE mc.slot_id = s.slot_id AND mc.status <> 'released') THEN 'held' "
    "ELSE 'sick' END) ORDER BY s.module_id)::text FROM node_resource_slots s "
    "WHERE s.node_id = n.node_id AND s.module_id IS NOT NULL AND s.status <> 'retired')"
)


def image_ready_sql(slug: Param, digest: Param) -> str:
    """Node `n` holds the image verified with the requested digest, or no gate applies (the slug
    parameter is NULL). Parameter positions are the caller's: each query numbers its own."""
    return (
        f"(${slug}::text IS NULL OR EXISTS (SELECT 1 FROM node_image_readiness r WHERE r.node_id = n.node_id "
        f"AND r.slug = ${slug} AND r.status = 'verified' AND r.schedulable AND r.digest_sha256 = ${digest}::text))"
    )


def fabric_manager_ok_sql(version: Param) -> str:
    """The SQL of the domain's `fabric_manager_mismatch`, negated: no driver version asked (`$version` NULL), node
    `n` places no NVLink partitions (no unretired slot with a module ID), or its Fabric Manager has that version."""
    return (
        f"(${version}::text IS NULL OR n.fabric_manager_version = ${version}::text OR NOT EXISTS (SELECT 1 FROM "
        "node_resource_slots fs WHERE fs.node_id = n.node_id AND fs.module_id IS NOT NULL AND fs.status <> 'retired'))"
    )


def _pages_per_gpu_sql(table: Param, slot: str) -> str:
    return f"COALESCE((${table}::jsonb ->> {slot}.profile)::int, 0)"


def hugepages_per_gpu_sql(table: Param) -> str:
    """1 GiB pages per GPU the slots of node `n` need: the most any counted slot's runtime profile asks.
    `$table` is `hugepage_table()`, the shared profile table as the database reads it."""
    return (
        f"(SELECT COALESCE(max({_pages_per_gpu_sql(table, 'hs')}), 0) FROM node_resource_slots hs "
        f"WHERE hs.node_id = n.node_id AND hs.{COUNTED_SLOT_SQL})"
    )


def hugepage_profiles_sql(table: Param) -> str:
    """The runtime profiles of node `n`'s counted slots that ask for 1 GiB pages (comma-joined; NULL: none), so
    a why-not answer can say which profile needs them."""
    return (
        f"(SELECT string_agg(DISTINCT hs.profile, ',' ORDER BY hs.profile) FROM node_resource_slots hs "
        f"WHERE hs.node_id = n.node_id AND hs.{COUNTED_SLOT_SQL} AND {_pages_per_gpu_sql(table, 'hs')} > 0)"
    )


def hugepages_held_sql(table: Param) -> str:
    """1 GiB pages the live slot claims on node `n` hold: the VMs placed there back their memory with them."""
    return (
        f"(SELECT COALESCE(sum({_pages_per_gpu_sql(table, 'hs')}), 0) FROM allocation_resource_claims hc "
        "JOIN node_resource_slots hs ON hs.slot_id = hc.slot_id "
        "WHERE hc.node_id = n.node_id AND hc.status <> 'released')"
    )


def hugepages_ok_sql(gpus: Param, table: Param) -> str:
    """Node `n` can back `$gpus` GPUs of its slots' profile with 1 GiB hugepages, or the profile needs none:
    the SQL of the domain's `hugepages_missing` and `hugepages_insufficient` filters together. The host's
    configured pages are the capacity and the scheduler's own claims the usage, as for GPUs; the free count
    a report carries is stale once a VM starts, and the agent re-checks the free pages at provision."""
    per_gpu = hugepages_per_gpu_sql(table)
    return f"({per_gpu} = 0 OR COALESCE(n.hugepages_1g_total, 0) - {hugepages_held_sql(table)} >= {per_gpu} * ${gpus})"


def hugepage_table() -> str:
    """The parameter the hugepage fragments read: profile -> 1 GiB pages per GPU, as JSON."""
    return json.dumps(hugepage_profiles(), sort_keys=True)


def gate_params(req_or_gate: Request | tuple[str, str] | None) -> tuple[str | None, str | None]:
    gate = req_or_gate.image_gate if isinstance(req_or_gate, Request) else req_or_gate
    return gate if gate is not None else (None, None)


NODE_SUMMARY_COLUMNS = "node_id, free_slots, total_slots, sliced, max_switch_free, numa_free, numa_capacity"


def slot_view(r: asyncpg.Record) -> SlotView:
    return SlotView(r["slot_id"], r["numa_node"], r["pcie_switch"], r["fabric_vf_pci_address"], r["module_id"])


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


TIER_SQL = {
    TIER_SWITCH: "n.max_switch_free >= $3",
    TIER_NUMA: "n.max_switch_free < $3 AND n.max_numa_free >= $3",
    TIER_SPAN: "n.max_numa_free < $3",
}
