"""Readiness evidence from the bus, recorded where placement already looks for it.

- `node.parity_reported` -> the node's parity columns, which SLICE_NODE_SQL and the `parity` filter
  gate on (a slice host takes slices only with failures = 0).
- `node.topology_reported` -> `candidate_slots`: advisory only. Nothing here ever creates or changes
  a slot; an operator approves candidates through the admin API.
- `image.node_cache_changed` -> `node_image_readiness`, read by the image cache gate of slice
  placement (see `inventory.image_gate`).

Each runs inside the bus handler's transaction, with the inbox row that makes a redelivery a no-op.
Reports are applied only when newer than the last one applied, so a late redelivery of an old report
(past JetStream's duplicate window) cannot roll the evidence back; and only when newer than the host's
last evidence reset (entering `converting`, see domain/host_mode.py), since a report from before
describes the host as it was before MAAS redeployed it.
"""

from __future__ import annotations

import json
from datetime import datetime

import asyncpg

from gpuaas_common.contract import messages as m
from gpuaas_common.logging import get_logger

log = get_logger(__name__)

# The fields of an agent-reported candidate that are copied as they are.
_CANDIDATE_FIELDS = ("gpu_pci_address", "numa_node", "pcie_switch", "nvme_by_id", "fabric_claim_mode",
                     "fabric_vf_pci_address", "mac", "private_ip", "ovs_bridge", "ovs_port")


async def record_parity(conn: asyncpg.Connection, ev: m.NodeParityReported) -> str:
    """'applied', 'stale' or 'unknown_node'."""
    detail = {"checks": [c.model_dump(mode="json") for c in ev.checks], "warnings": ev.warnings,
              "task_id": ev.task_id, "source": "node-agent"}
    row = await conn.fetchrow(
        "UPDATE nodes SET parity_failures = $2, parity_detail = $3::jsonb, parity_checked_at = $4, "
        "parity_reported_at = $4, updated_at = now() "
        "WHERE node_id = $1 AND (parity_reported_at IS NULL OR parity_reported_at <= $4) "
        "AND (evidence_reset_at IS NULL OR evidence_reset_at < $4) RETURNING node_id",
        ev.node_id, ev.failures, json.dumps(detail), ev.checked_at,
    )
    return "applied" if row else await _why_not_applied(conn, ev.node_id)


async def record_topology(conn: asyncpg.Connection, ev: m.NodeTopologyReported) -> str:
    """Replace the node's unapproved candidates with the reported ones; 'applied', 'stale' or
    'unknown_node'. Approved candidates are the operator's record of what became a slot: kept, and a
    reported candidate for the same GPU (or id) is not stored beside them."""
    node = await conn.fetchrow(
        "UPDATE nodes SET topology_reported_at = $2, topology_blockers = $3::jsonb, updated_at = now() "
        "WHERE node_id = $1 AND (topology_reported_at IS NULL OR topology_reported_at <= $2) "
        "AND (evidence_reset_at IS NULL OR evidence_reset_at < $2) RETURNING node_id",
        ev.node_id, ev.discovered_at, json.dumps(ev.blockers),
    )
    if node is None:
        return await _why_not_applied(conn, ev.node_id)
    await conn.execute("DELETE FROM candidate_slots WHERE node_id = $1 AND approved_slot_id IS NULL", ev.node_id)
    disks = {d.by_id: d for d in ev.nvme if d.by_id}
    rows = []
    for c in ev.candidate_slots:
        disk = disks.get(c.nvme_by_id) if c.nvme_by_id else None
        # The approval rules read the disk evidence in this shape; no evidence means not approvable.
        evidence = json.dumps({"mounted": disk.mounted, "mounted_children": disk.mounted_children,
                               "signatures": disk.signatures, "is_os_disk": disk.is_os_disk}) if disk else None
        rows.append((candidate_id(ev.node_id, c.gpu_pci_address), ev.node_id,
                     *(getattr(c, f) for f in _CANDIDATE_FIELDS), evidence))
    if rows:
        cols = ", ".join(_CANDIDATE_FIELDS)
        await conn.executemany(
            f"INSERT INTO candidate_slots (candidate_id, node_id, {cols}, nvme_evidence, source) "
            f"VALUES ($1, $2, {', '.join(f'${i + 3}' for i in range(len(_CANDIDATE_FIELDS)))}, "
            f"${len(_CANDIDATE_FIELDS) + 3}::jsonb, 'node-agent') ON CONFLICT DO NOTHING",
            rows,
        )
    return "applied"


def candidate_id(node_id: str, gpu_pci_address: str) -> str:
    # Keyed by the GPU, the one stable identity in a report (its index may shift between discoveries),
    # so re-discovery replaces a candidate in place and approval keeps a stable slot id.
    return f"{node_id}-{gpu_pci_address}"


async def record_image_cache(conn: asyncpg.Connection, ev: m.ImageNodeCacheChanged, occurred_at: datetime) -> str:
    """'applied' or 'stale'. The payload carries no time of its own; the envelope's does."""
    row = await conn.fetchrow(
        "INSERT INTO node_image_readiness (node_id, slug, status, digest_sha256, schedulable, reported_at) "
        "VALUES ($1, $2, $3, $4, $5, $6) ON CONFLICT (node_id, slug) DO UPDATE SET status = EXCLUDED.status, "
        "digest_sha256 = EXCLUDED.digest_sha256, schedulable = EXCLUDED.schedulable, "
        "reported_at = EXCLUDED.reported_at, updated_at = now() "
        "WHERE node_image_readiness.reported_at <= EXCLUDED.reported_at RETURNING node_id",
        ev.node_id, ev.slug, ev.status, ev.digest_sha256, ev.schedulable, occurred_at,
    )
    return "applied" if row else "stale"


async def _why_not_applied(conn: asyncpg.Connection, node_id: str) -> str:
    exists = await conn.fetchval("SELECT 1 FROM nodes WHERE node_id = $1", node_id)
    # An unknown node is not an error to retry: the scheduler learns nodes from the fleet file or the
    # admin API, and the agent reports again at its next start or discovery task.
    return "stale" if exists else "unknown_node"
