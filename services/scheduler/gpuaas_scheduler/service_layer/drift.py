"""`node.drift_reported` -> the node's current drift (see domain/drift.py), which keeps drifted slots, or the
whole node, out of slice placement until the agent reports them clean or ops acknowledge them.

Runs inside the bus handler's transaction with the inbox row. A report older than the last one applied, or
than the host's evidence reset, changes nothing (a late redelivery must not reopen drift that a newer report
resolved; `Host.record_drift`); every applied report is kept as it came in `node_drift_reports`."""

from __future__ import annotations

from gpuaas_common.contract import messages as m

from ..domain.drift import current_items
from ..domain.evidence_clock import as_received
from .ports import EvidenceRepositories


async def record_drift(
    repos: EvidenceRepositories, ev: m.NodeDriftReported, event_id: str, *, keep: int = 1000
) -> dict[str, int | str]:
    """{'outcome': 'applied' | 'stale' | 'unknown_node', 'opened', 'resolved', 'held'}; the node keeps its `keep`
    newest reports (the report is taken under the node's row lock, so two replicas never trim at once)."""
    host = await repos.hosts.get(ev.node_id)
    if host is None:
        return {"outcome": "unknown_node"}
    slots = await repos.drift.node_slots(ev.node_id)
    reported = current_items(((d.kind, d.subject, d.detail, d.swept, d.slot_ids, d.devices) for d in ev.drift), slots)
    change = host.record_drift(
        event_id=event_id,
        checked_at=as_received(ev.checked_at),
        report=[d.model_dump(mode="json") for d in ev.drift],
        reported=reported,
        held=await repos.drift.held_keys(ev.node_id),
        keep=keep,
    )
    if change is None:
        return {"outcome": "stale"}
    await repos.hosts.save(host)
    return {
        "outcome": "applied",
        "opened": len(change.open),
        "resolved": len(change.resolve),
        "held": len(change.still),
    }
