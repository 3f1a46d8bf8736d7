"""Readiness evidence from the bus, recorded where placement already looks for it.

- `node.parity_reported` -> the node's parity columns, which SLICE_NODE_SQL and the `parity` filter
  gate on (a slice host takes slices only with failures = 0).
- `node.topology_reported` -> `candidate_slots`: advisory only. Nothing here ever creates or changes
  a slot; an operator approves candidates through the admin API. Its 1 GiB hugepage counts go on the
  node: capability evidence the `hugepages_missing` / `hugepages_insufficient` filters gate on for
  slots whose runtime profile opts into hugepages; so does its Fabric Manager (mode, version). Each candidate
  carries its GPU's module ID, which approval checks (domain/approval.py, `module_problems`).
- `node.slice_preflight_reported` (MAAS gateway, after a commissioning run) -> a `node_slice_preflight`
  row (the evidence, kept) and the node's `preflight_status`, which SLICE_NODE_SQL and the
  `preflight_failed` / `preflight_missing` filters gate on. The machine is mapped to its node by
  `maas_system_id`; a report for a machine no node carries is kept with no node.
- `image.node_cache_changed` -> `node_image_readiness`, read by the image cache gate of slice
  placement (see `domain.placement.request.image_gate`).

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

from ..adapters import evidence as repo
from ..domain.evidence_clock import as_received

log = get_logger(__name__)


async def record_parity(conn: asyncpg.Connection, ev: m.NodeParityReported, *, allow_emulated: bool = False) -> str:
    """'applied', 'stale' or 'unknown_node'. A report of the emulated profile (a lab host: its hardware checks
    were not applicable) counts as passing only where emulated slots are allowed; elsewhere it is recorded
    with one failure more, naming why, so the host never takes slices on the strength of checks it skipped."""
    failures = ev.failures
    detail = {
        "checks": [c.model_dump(mode="json") for c in ev.checks],
        "warnings": ev.warnings,
        "task_id": ev.task_id,
        "source": "node-agent",
        "profile": ev.profile,
    }
    if ev.profile == "emulated" and not allow_emulated:
        failures += 1
        detail["refused"] = "emulated parity profile: this scheduler does not allow emulated slots"
    if await repo.update_parity(conn, ev.node_id, failures, detail, as_received(ev.checked_at)):
        return "applied"
    return await _why_not_applied(conn, ev.node_id)


async def record_topology(conn: asyncpg.Connection, ev: m.NodeTopologyReported) -> str:
    """Replace the node's unapproved candidates with the reported ones; 'applied', 'stale' or
    'unknown_node'. Approved candidates are the operator's record of what became a slot: kept, and a
    reported candidate for the same GPU (or id) is not stored beside them."""
    fm = ev.fabric_manager
    if not await repo.update_topology(
        conn,
        ev.node_id,
        as_received(ev.discovered_at),
        ev.blockers,
        ev.hugepages_1g_total,
        ev.hugepages_1g_free,
        (fm.mode, fm.version, fm.active) if fm else (None, None, None),
    ):
        return await _why_not_applied(conn, ev.node_id)
    disks = {d.by_id: d for d in ev.nvme if d.by_id}
    rows = []
    for c in ev.candidate_slots:
        disk = disks.get(c.nvme_by_id) if c.nvme_by_id else None
        # The approval rules read the disk evidence in this shape; no evidence means not approvable.
        evidence = (
            json.dumps(
                {
                    "mounted": disk.mounted,
                    "mounted_children": disk.mounted_children,
                    "signatures": disk.signatures,
                    "is_os_disk": disk.is_os_disk,
                }
            )
            if disk
            else None
        )
        rows.append(
            (
                candidate_id(ev.node_id, c.gpu_pci_address or c.nvme_by_id or f"slot{c.index}"),
                ev.node_id,
                *(getattr(c, f) for f in repo.CANDIDATE_FIELDS),
                evidence,
            )
        )
    await repo.replace_unapproved_candidates(conn, ev.node_id, rows)
    return "applied"


def candidate_id(node_id: str, gpu_pci_address: str) -> str:
    # Keyed by the GPU, the one stable identity in a report (its index may shift between discoveries),
    # so re-discovery replaces a candidate in place and approval keeps a stable slot id. An emulated slot has
    # no GPU: its disk's by-id path is its stable identity.
    return f"{node_id}-{gpu_pci_address.removeprefix('/dev/disk/by-id/')}"


async def record_image_cache(conn: asyncpg.Connection, ev: m.ImageNodeCacheChanged, occurred_at: datetime) -> str:
    """'applied' or 'stale'. The payload carries no time of its own; the envelope's does."""
    applied = await repo.upsert_image_readiness(
        conn, ev.node_id, ev.slug, ev.status, ev.digest_sha256, ev.schedulable, as_received(occurred_at)
    )
    return "applied" if applied else "stale"


async def _why_not_applied(conn: asyncpg.Connection, node_id: str) -> str:
    # An unknown node is not an error to retry: the scheduler learns nodes from the fleet file or the
    # admin API, and the agent reports again at its next start or discovery task.
    return "stale" if await repo.node_exists(conn, node_id) else "unknown_node"


async def record_slice_preflight(conn: asyncpg.Connection, ev: m.NodeSlicePreflightReported) -> str:
    """'applied', 'stale', 'duplicate' or 'unknown_node' (the evidence row is kept in every case but a duplicate)."""
    node_id = await repo.node_for_machine(conn, ev.system_id, ev.node_id)
    if not await repo.insert_slice_preflight(conn, node_id, ev.model_dump(mode="python")):
        return "duplicate"
    if node_id is None:
        return "unknown_node"
    if await repo.update_preflight(conn, node_id, ev.status, as_received(ev.reported_at), ev.operation_id):
        return "applied"
    return "stale"
