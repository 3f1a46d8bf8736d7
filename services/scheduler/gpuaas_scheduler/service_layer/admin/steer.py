"""Asks of a host through the admin API: rediscovery, a parity run, a commissioning. Each answers at once with the
ask as recorded (the host's report closes it later: `GET /v1/nodes/{node_id}` lists the node's asks and what each
found); a refusal names every reason and writes nothing."""

from __future__ import annotations

from typing import Any

import asyncpg

from gpuaas_common.outbox import EventCollector

from ...adapters import admin_nodes as repo
from .. import steering
from .common import action_view, lock_node
from .models import Acted, AdminError
from .nodes import get_node


async def steer(
    conn: asyncpg.Connection,
    events: EventCollector,
    policy: steering.SteeringPolicy,
    node_id: str,
    kind: str,
    body: Acted,
) -> dict[str, Any]:
    await lock_node(conn, node_id)
    try:
        row = await steering.ask(conn, events, policy, node_id, kind, actor=body.actor, reason=body.reason)
    except steering.UnknownNode:
        raise AdminError(404, "node_not_found", f"no node {node_id!r}") from None
    except steering.AskRefused as exc:
        raise AdminError(409, "ask_refused", str(exc), {"kind": kind, "problems": exc.problems}) from None
    await repo.audit(conn, body.actor, f"node.{kind}", node_id, body.reason, {"action_id": row["action_id"]})
    return {**await get_node(conn, node_id), "action": action_view(row)}
