"""`node.drift_reported` -> the node's current drift (see domain/drift.py), which keeps drifted slots, or the
whole node, out of slice placement until the agent reports them clean or ops acknowledge them.

Runs inside the bus handler's transaction with the inbox row. A report older than the last one applied, or
than the host's evidence reset, changes nothing (a late redelivery must not reopen drift that a newer report
resolved); every applied report is kept as it came in `node_drift_reports`."""

from __future__ import annotations

import asyncpg

from gpuaas_common.contract import messages as m

from ..adapters import drift as repo
from ..adapters import evidence as evidence_repo
from ..adapters import inventory as inv
from ..domain.drift import current_items, reconcile
from ..domain.evidence_clock import as_received


async def record_drift(
    conn: asyncpg.Connection, ev: m.NodeDriftReported, event_id: str, *, keep: int = 1000
) -> dict[str, int | str]:
    """{'outcome': 'applied' | 'stale' | 'unknown_node', 'opened', 'resolved', 'held'}; the node keeps its `keep`
    newest reports (the report is taken under the node's row lock, so two replicas never trim at once)."""
    ev = ev.model_copy(update={"checked_at": as_received(ev.checked_at)})
    if not await repo.take_report(conn, ev.node_id, ev.checked_at):
        known = await evidence_repo.node_exists(conn, ev.node_id)
        return {"outcome": "stale" if known else "unknown_node"}
    await repo.insert_report(conn, event_id, ev.node_id, ev.checked_at, [d.model_dump(mode="json") for d in ev.drift])
    await repo.trim_reports(conn, ev.node_id, keep)
    slots = await repo.node_slots(conn, ev.node_id)
    reported = current_items(((d.kind, d.subject, d.detail, d.swept, d.slot_ids, d.devices) for d in ev.drift), slots)
    change = reconcile(await repo.held_keys(conn, ev.node_id), reported)
    await repo.resolve_items(conn, ev.node_id, change.resolve, ev.checked_at, "node-agent report")
    await repo.touch_items(conn, ev.node_id, change.still, ev.checked_at)
    await repo.open_items(conn, ev.node_id, change.open, ev.checked_at)
    await repo.refresh_node_flag(conn, ev.node_id)
    await inv.refresh_nodes(conn, [ev.node_id])
    return {
        "outcome": "applied",
        "opened": len(change.open),
        "resolved": len(change.resolve),
        "held": len(change.still),
    }
