"""Host modes through the admin API: the mode with what blocks each way out, and guarded changes."""

from __future__ import annotations

import asyncpg

from gpuaas_common.outbox import EventCollector

from ...adapters import admin_nodes as repo
from ...adapters import host_modes as mode_repo
from ...domain.host_mode import TRANSITIONS, ModeRefused
from .. import host_modes
from ..vfio_binding import ask_binding
from .common import jsonable, lock_node
from .models import AdminError, ModeIn


async def get_mode(conn: asyncpg.Connection, node_id: str) -> dict:
    """The node's mode with who/why/when, what each transition out of it still needs, and its history."""
    loaded = await mode_repo.load_host(conn, node_id)
    if loaded is None:
        raise AdminError(404, "node_not_found", f"no node {node_id!r}")
    host, _ = loaded
    row = await repo.mode_record(conn, node_id)
    transitions = {to: host.blockers(to) for (frm, to) in TRANSITIONS if frm == host.mode}
    history = await mode_repo.history(conn, node_id)
    return {
        "node_id": node_id,
        "mode": host.mode,
        **jsonable(row),
        "transitions": transitions,
        "history": [jsonable(h) for h in history],
    }


async def set_mode(conn: asyncpg.Connection, node_id: str, body: ModeIn, *, events: EventCollector) -> dict:
    """A guarded change; entering slice mode asks the host to bind its approved devices, leaving the modes that
    keep slices asks it to release them (in the same transaction: vfio_binding.py)."""
    await lock_node(conn, node_id)
    try:
        change = await host_modes.change_mode(conn, node_id, body.mode, actor=body.actor, reason=body.reason)
    except ModeRefused as exc:
        raise AdminError(
            409,
            "mode_transition_refused",
            str(exc),
            {
                "from": exc.current,
                "to": exc.target,
                "problems": exc.problems,
                "allowed": [to for (frm, to) in TRANSITIONS if frm == exc.current],
            },
        ) from None
    vfio_task = await ask_binding(conn, events, node_id, change.from_mode, change.to_mode)
    await host_modes.announce(events, change)
    await repo.audit(
        conn,
        body.actor,
        "node.mode",
        node_id,
        body.reason,
        {
            "from": change.from_mode,
            "to": change.to_mode,
            "evidence_reset": change.resets_evidence,
            **({"vfio_task": vfio_task} if vfio_task else {}),
        },
    )
    return await get_mode(conn, node_id)
