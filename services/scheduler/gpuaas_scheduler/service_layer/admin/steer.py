"""Asks of a host through the admin API: rediscovery, a parity run, a commissioning. Each answers at once with the
ask as recorded (the host's report closes it later: `GET /v1/nodes/{node_id}` lists the node's asks and what each
found); a refusal names every reason and writes nothing."""

from __future__ import annotations

from typing import Any

from .. import steering
from ..ports import AdminUnitOfWork, AskNode
from .common import action_view, node_not_found, require_node
from .models import Acted, AdminError
from .nodes import get_node


async def steer(uow: AdminUnitOfWork, ask: AskNode, node_id: str, kind: str, body: Acted) -> dict[str, Any]:
    """`ask`: steering's ask, bound by the caller to this unit of work and the steering policy."""
    await require_node(uow.repos.node_admin, node_id)
    try:
        row = await ask(node_id, kind, actor=body.actor, reason=body.reason)
    except steering.UnknownNode:
        raise node_not_found(node_id) from None
    except steering.AskRefused as exc:
        raise AdminError(409, "ask_refused", str(exc), {"kind": kind, "problems": exc.problems}) from None
    await uow.repos.audit.record(body.actor, f"node.{kind}", node_id, body.reason, {"action_id": row["action_id"]})
    return {**await get_node(uow.repos.node_admin, node_id), "action": action_view(row)}
