"""Host modes through the admin API: the mode with what blocks each way out, and guarded changes."""

from __future__ import annotations

from typing import Any

from gpuaas_common.logging import get_logger

from ...domain.host_mode import TRANSITIONS, ModeRefused, allowed_targets
from ..hosts import publish
from ..ports import AdminNodes, HostUnitOfWork
from .common import jsonable, load_host, node_not_found
from .models import AdminError, ModeIn

log = get_logger(__name__)


async def get_mode(nodes: AdminNodes, node_id: str) -> dict[str, Any]:
    """The node's mode with who/why/when, what each transition out of it still needs, and its history."""
    host = await nodes.modes(node_id)
    row = await nodes.mode_record(node_id)
    if host is None or row is None:
        raise node_not_found(node_id)
    transitions = {to: host.blockers(to) for (frm, to) in TRANSITIONS if frm == host.mode}
    history = await nodes.mode_history(node_id)
    return {
        "node_id": node_id,
        "mode": host.mode,
        **jsonable(row),
        "transitions": transitions,
        "history": [jsonable(h) for h in history],
    }


async def set_mode(uow: HostUnitOfWork, node_id: str, body: ModeIn) -> dict[str, Any]:
    """A guarded change; entering slice mode asks the host to bind its approved devices, leaving the modes that
    keep slices asks it to release them (in the same transaction: vfio_binding.py)."""
    host = await load_host(uow, node_id)
    try:
        change = host.change_mode(body.mode, actor=body.actor, reason=body.reason)
    except ModeRefused as exc:
        raise AdminError(
            409,
            "mode_transition_refused",
            str(exc),
            {"from": exc.current, "to": exc.target, "problems": exc.problems, "allowed": allowed_targets(exc.current)},
        ) from None
    published = await publish(uow, node_id, await uow.repos.hosts.save(host))
    log.info("host_mode_changed", node_id=node_id, from_mode=change.from_mode, to_mode=change.to_mode, actor=body.actor)
    vfio = {"vfio_task": published.vfio_task} if published.vfio_task else {}
    detail = {"from": change.from_mode, "to": change.to_mode, "evidence_reset": change.resets_evidence, **vfio}
    await uow.repos.audit.record(body.actor, "node.mode", node_id, body.reason, detail)
    return {}
