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
from typing import Any

from gpuaas_common.contract import messages as m
from gpuaas_common.logging import get_logger

from ..adapters.evidence import CANDIDATE_FIELDS
from ..domain.evidence_clock import as_received
from ..domain.host import APPLIED, STALE
from .ports import Evidence, EvidenceRepositories

log = get_logger(__name__)

UNKNOWN_NODE = "unknown_node"
EMULATED_REFUSED = "emulated parity profile: this scheduler does not allow emulated slots"


async def record_parity(repos: EvidenceRepositories, ev: m.NodeParityReported, *, allow_emulated: bool = False) -> str:
    """'applied', 'stale' or 'unknown_node'. A report of the emulated profile (a lab host: its hardware checks
    were not applicable) counts as passing only where emulated slots are allowed; elsewhere it is recorded
    with one failure more, naming why, so the host never takes slices on the strength of checks it skipped."""
    # An unknown node is not an error to retry: the scheduler learns nodes from the fleet file or the
    # admin API, and the agent reports again at its next start or discovery task.
    host = await repos.hosts.get(ev.node_id)
    if host is None:
        return UNKNOWN_NODE
    detail = {
        "checks": [c.model_dump(mode="json") for c in ev.checks],
        "warnings": ev.warnings,
        "task_id": ev.task_id,
        "source": "node-agent",
        "profile": ev.profile,
    }
    refused = EMULATED_REFUSED if ev.profile == "emulated" and not allow_emulated else None
    outcome = host.record_parity(
        failures=ev.failures, detail=detail, checked_at=as_received(ev.checked_at), emulated_refused=refused
    )
    await repos.hosts.save(host)
    return outcome


async def record_topology(repos: EvidenceRepositories, ev: m.NodeTopologyReported) -> str:
    """Replace the node's unapproved candidates with the reported ones; 'applied', 'stale' or
    'unknown_node'. Approved candidates are the operator's record of what became a slot: kept, and a
    reported candidate for the same GPU (or id) is not stored beside them."""
    host = await repos.hosts.get(ev.node_id)
    if host is None:
        return UNKNOWN_NODE
    fm = ev.fabric_manager
    outcome = host.record_topology(
        discovered_at=as_received(ev.discovered_at),
        blockers=ev.blockers,
        hugepages_1g=(ev.hugepages_1g_total, ev.hugepages_1g_free),
        fabric_manager=(fm.mode, fm.version, fm.active) if fm else (None, None, None),
        candidates=candidate_rows(ev),
    )
    await repos.hosts.save(host)
    return outcome


def candidate_rows(ev: m.NodeTopologyReported) -> list[tuple[Any, ...]]:
    """The report's candidates as stored: (candidate_id, node_id, *CANDIDATE_FIELDS, nvme evidence json or None)."""
    disks = {d.by_id: d for d in ev.nvme if d.by_id}
    rows = []
    for c in ev.candidate_slots:
        disk = disks.get(c.nvme_by_id) if c.nvme_by_id else None
        rows.append(
            (
                candidate_id(ev.node_id, c.gpu_pci_address or c.nvme_by_id or f"slot{c.index}"),
                ev.node_id,
                *(getattr(c, f) for f in CANDIDATE_FIELDS),
                _disk_evidence(disk),
            )
        )
    return rows


def _disk_evidence(disk: m.NvmeDevice | None) -> str | None:
    # The approval rules read the disk evidence in this shape; no evidence means not approvable.
    if disk is None:
        return None
    return json.dumps(
        {
            "mounted": disk.mounted,
            "mounted_children": disk.mounted_children,
            "signatures": disk.signatures,
            "is_os_disk": disk.is_os_disk,
        }
    )


def candidate_id(node_id: str, gpu_pci_address: str) -> str:
    # Keyed by the GPU, the one stable identity in a report (its index may shift between discoveries),
    # so re-discovery replaces a candidate in place and approval keeps a stable slot id. An emulated slot has
    # no GPU: its disk's by-id path is its stable identity.
    return f"{node_id}-{gpu_pci_address.removeprefix('/dev/disk/by-id/')}"


async def record_image_cache(repos: EvidenceRepositories, ev: m.ImageNodeCacheChanged, occurred_at: datetime) -> str:
    """'applied' or 'stale'. The payload carries no time of its own; the envelope's does."""
    evidence: Evidence = repos.evidence
    applied = await evidence.upsert_image_readiness(
        ev.node_id, ev.slug, ev.status, ev.digest_sha256, ev.schedulable, as_received(occurred_at)
    )
    return APPLIED if applied else STALE


async def record_slice_preflight(repos: EvidenceRepositories, ev: m.NodeSlicePreflightReported) -> str:
    """'applied', 'stale', 'duplicate' or 'unknown_node' (the evidence row is kept in every case but a duplicate)."""
    evidence: Evidence = repos.evidence
    node_id = await evidence.node_for_machine(ev.system_id, ev.node_id)
    if not await evidence.insert_slice_preflight(node_id, ev.model_dump(mode="python")):
        return "duplicate"
    if node_id is None:
        return UNKNOWN_NODE
    if await evidence.update_preflight(node_id, ev.status, as_received(ev.reported_at), ev.operation_id):
        return APPLIED
    return STALE
