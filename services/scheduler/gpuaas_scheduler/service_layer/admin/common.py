"""What the admin operations share: the node lock, the JSON view of a row, all-or-nothing id lists."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

from ...adapters import admin_nodes as nodes_repo
from ...domain.host import Host
from ..ports import AdminNodes, HostUnitOfWork
from .models import AdminError


def jsonable(row: Mapping[str, Any]) -> dict[str, Any]:
    out = {}
    for k, v in dict(row).items():
        if hasattr(v, "isoformat"):
            v = v.isoformat()
        elif k in ("nvme_evidence", "parity_detail", "detail") and isinstance(v, str):
            v = json.loads(v)
        elif k == "allocation_id" and v is not None:
            v = str(v)
        out[k] = v
    return out


def action_view(row: Mapping[str, Any]) -> dict[str, Any]:
    """An ask of a node (node_actions) as JSON: its result is the reports' parts."""
    d = dict(row)
    result = d.pop("result", None)
    out = jsonable(d)
    out["result"] = json.loads(result) if isinstance(result, str) else (result or {})
    return out


def node_not_found(node_id: str) -> AdminError:
    return AdminError(404, "node_not_found", f"no node {node_id!r}")


async def require_node(nodes: AdminNodes, node_id: str) -> None:
    """The node's row lock (inventory's protocol: the node first); 404 for no such node."""
    if not await nodes.lock(node_id):
        raise node_not_found(node_id)


async def lock_node(conn: Any, node_id: str) -> Any:
    """The slots admin's node lock on its connection, until slots.py goes through the ports (issue 39)."""
    row = await nodes_repo.lock_node(conn, node_id)
    if row is None:
        raise node_not_found(node_id)
    return row


async def load_host(uow: HostUnitOfWork, node_id: str) -> Host:
    """The node's `Host`, locked; 404 for no such node."""
    host = await uow.repos.hosts.get(node_id)
    if host is None:
        raise node_not_found(node_id)
    return host


def require_all(asked: list[Any] | None, found: Iterable[Mapping[str, Any]], key: str, code: str, message: str) -> None:
    """A request naming ids refuses as a whole when any of them is not there (404 lists them all)."""
    if asked is None:
        return
    missing = sorted(set(asked) - {r[key] for r in found})
    if missing:
        raise AdminError(404, code, message, {f"{key}s": missing})
