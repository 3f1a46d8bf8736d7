"""Host drift for ops: what the node agent's reconciler reported on a node, and the acknowledgement that puts
the drifted slots (or the node) back into placement while the agent still reports them (see domain/drift.py).
A newer report that no longer names an item resolves it without ops."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Annotated, Any

from pydantic import Field

from ..ports import AdminUnitOfWork, DriftLog
from .common import node_not_found, require_all, require_node
from .models import Acted, AdminError

DriftId = Annotated[int, Field(ge=1, le=2**62)]


class DriftAckIn(Acted):
    # Absent: every open item of the node.
    drift_ids: list[DriftId] | None = Field(default=None, min_length=1, max_length=256)


def _row(r: Mapping[str, Any]) -> dict[str, Any]:
    # Not common.jsonable: that reads a `detail` column as JSON, and drift's detail is the agent's words.
    out = {}
    for k, v in dict(r).items():
        if hasattr(v, "isoformat"):
            v = v.isoformat()
        elif k == "devices" and isinstance(v, str):
            v = json.loads(v)
        out[k] = v
    return out


async def list_drift(drift: DriftLog, node_id: str, status: str | None = None) -> dict[str, Any]:
    """Unresolved drift by default; `status` open, acknowledged, resolved or all."""
    node = await drift.node_flags(node_id)
    if node is None:
        raise node_not_found(node_id)
    rows = await drift.items(node_id, include_resolved=status in ("resolved", "all"))
    if status not in (None, "all"):
        rows = [r for r in rows if r["status"] == status]
    return {
        "node_id": node_id,
        "drift_open": node["drift_open"],
        "drift_reported_at": node["drift_reported_at"].isoformat() if node["drift_reported_at"] else None,
        "drift": [_row(r) for r in rows],
    }


async def _check_open(drift: DriftLog, node_id: str, drift_ids: list[int]) -> None:
    """Every id named is the node's and open, or the whole request is refused."""
    found = await drift.by_id(node_id, drift_ids)
    require_all(drift_ids, found, "drift_id", "drift_not_found", f"no such drift on node {node_id!r}")
    not_open = sorted(r["drift_id"] for r in found if r["status"] != "open")
    if not_open:
        raise AdminError(409, "drift_not_open", "only open drift can be acknowledged", {"drift_ids": not_open})


async def ack_drift(uow: AdminUnitOfWork, node_id: str, body: DriftAckIn) -> dict[str, Any]:
    """Open drift of the node (every item, or the ids named, all or nothing) -> acknowledged."""
    drift = uow.repos.drift_log
    await require_node(uow.repos.node_admin, node_id)
    if body.drift_ids is not None:
        await _check_open(drift, node_id, body.drift_ids)
    changed = await drift.acknowledge(node_id, body.drift_ids, body.actor, body.reason)
    if not changed:
        raise AdminError(409, "no_open_drift", f"node {node_id!r} has no open drift to acknowledge")
    ids = [r["drift_id"] for r in changed]
    slot_ids = sorted({r["slot_id"] or "(node)" for r in changed})
    await uow.repos.audit.record(
        body.actor, "node.drift_ack", node_id, body.reason, {"drift_ids": ids, "slot_ids": slot_ids}
    )
    return {**await list_drift(drift, node_id), "acknowledged": ids}
