"""Host drift for ops: what the node agent's reconciler reported on a node, and the acknowledgement that puts
the drifted slots (or the node) back into placement while the agent still reports them (see domain/drift.py).
A newer report that no longer names an item resolves it without ops."""

from __future__ import annotations

import json
from typing import Annotated

import asyncpg
from pydantic import Field

from ...adapters import admin_nodes as nodes_repo
from ...adapters import drift as repo
from ...adapters import inventory as inv
from .common import lock_node, require_all
from .models import Acted, AdminError

DriftId = Annotated[int, Field(ge=1, le=2**62)]


class DriftAckIn(Acted):
    # Absent: every open item of the node.
    drift_ids: list[DriftId] | None = Field(default=None, min_length=1, max_length=256)


def _row(r: asyncpg.Record) -> dict:
    # Not common.jsonable: that reads a `detail` column as JSON, and drift's detail is the agent's words.
    out = {}
    for k, v in dict(r).items():
        if hasattr(v, "isoformat"):
            v = v.isoformat()
        elif k == "devices" and isinstance(v, str):
            v = json.loads(v)
        out[k] = v
    return out


async def _view(conn: asyncpg.Connection, node_id: str, status: str | None) -> dict:
    node = await conn.fetchrow("SELECT drift_open, drift_reported_at FROM nodes WHERE node_id = $1", node_id)
    if node is None:
        raise AdminError(404, "node_not_found", f"no node {node_id!r}")
    rows = await repo.list_drift(conn, node_id, include_resolved=status in ("resolved", "all"))
    if status not in (None, "all"):
        rows = [r for r in rows if r["status"] == status]
    return {
        "node_id": node_id,
        "drift_open": node["drift_open"],
        "drift_reported_at": node["drift_reported_at"].isoformat() if node["drift_reported_at"] else None,
        "drift": [_row(r) for r in rows],
    }


async def list_drift(conn: asyncpg.Connection, node_id: str, status: str | None = None) -> dict:
    """Unresolved drift by default; `status` open, acknowledged, resolved or all."""
    return await _view(conn, node_id, status)


async def ack_drift(conn: asyncpg.Connection, node_id: str, body: DriftAckIn) -> dict:
    """Open drift of the node (every item, or the ids named, all or nothing) -> acknowledged."""
    await lock_node(conn, node_id)
    if body.drift_ids is not None:
        found = await repo.drift_by_id(conn, node_id, body.drift_ids)
        require_all(body.drift_ids, found, "drift_id", "drift_not_found", f"no such drift on node {node_id!r}")
        not_open = sorted(r["drift_id"] for r in found if r["status"] != "open")
        if not_open:
            raise AdminError(409, "drift_not_open", "only open drift can be acknowledged", {"drift_ids": not_open})
    changed = await repo.acknowledge(conn, node_id, body.drift_ids, body.actor, body.reason)
    if not changed:
        raise AdminError(409, "no_open_drift", f"node {node_id!r} has no open drift to acknowledge")
    await repo.refresh_node_flag(conn, node_id)
    await inv.refresh_nodes(conn, [node_id])
    ids = [r["drift_id"] for r in changed]
    await nodes_repo.audit(
        conn,
        body.actor,
        "node.drift_ack",
        node_id,
        body.reason,
        {"drift_ids": ids, "slot_ids": sorted({r["slot_id"] or "(node)" for r in changed})},
    )
    out = await _view(conn, node_id, None)
    out["acknowledged"] = ids
    return out
