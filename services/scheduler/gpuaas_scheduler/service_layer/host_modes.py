"""Host mode changes inside the caller's transaction, under the node's row lock: the return of a host from a
baremetal allocation (release), the end of a conversion once rediscovery, parity and re-approval are all in (slot
approval), and their announcement. An operator's request is `Host.change_mode` (admin/modes.py)."""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any

from gpuaas_common.contract import derived_event_id
from gpuaas_common.contract import messages as m
from gpuaas_common.logging import get_logger
from gpuaas_common.outbox import EventCollector

from ..adapters.host_modes import HostModeRepository
from ..domain.host_mode import CONVERTING, SLICE, Host, ModeChange, ModeRefused
from .ports import HostModes, Hosts

log = get_logger(__name__)


class UnknownNode(Exception):
    pass


async def _load(modes: HostModes, node_id: str) -> tuple[Host, datetime]:
    loaded = await modes.load(node_id)
    if loaded is None:
        raise UnknownNode(node_id)
    return loaded


async def return_from_baremetal(hosts: Hosts, node_id: str, allocation_id: uuid.UUID) -> str:
    """After the node's baremetal claim was released (the caller holds the node lock): the mode it is
    in now."""
    host = await hosts.get(node_id)
    if host is None:
        raise UnknownNode(node_id)
    try:
        change = host.return_from_baremetal(
            actor="scheduler",
            allocation_id=str(allocation_id),
            reason=f"baremetal allocation {allocation_id} released: MAAS redeployed the host, its slice bootstrap, "
            "parity and topology must be established again",
        )
    except ModeRefused as exc:
        # Only reachable through hand edits (the guards kept slots off a baremetal host). The host stays
        # in baremetal mode, where its unretired slots keep it from every placement until ops act.
        log.warning("host_return_refused", node_id=node_id, problems=exc.problems)
        return host.mode
    if change is not None:
        await hosts.save(host)
        log.info(
            "host_mode_changed", node_id=node_id, from_mode=change.from_mode, to_mode=change.to_mode, actor=change.actor
        )
    return host.mode


async def promote_if_ready(
    modes: HostModes | Any, node_id: str, *, actor: str, reason: str, events: EventCollector | None = None
) -> tuple[str, list[str]]:
    """converting → slice when rediscovery, a passing parity run and re-approval are all in. The mode
    after, and what still blocks slice mode when the host stays converting. `events`: the change is announced.
    `modes`: a repository, or (the admin layer's callers, until they move to ports) a connection to wrap."""
    if not hasattr(modes, "load"):
        modes = HostModeRepository(modes)
    host, now = await _load(modes, node_id)
    if host.mode != CONVERTING:
        return host.mode, []
    blockers = host.blockers(SLICE)
    if blockers:
        return host.mode, blockers
    change = host.change_mode(SLICE, actor=actor, reason=reason, at=now)
    await modes.save(host)
    log.info("host_mode_changed", node_id=node_id, from_mode=CONVERTING, to_mode=SLICE, actor=actor)
    if events is not None:
        await announce(events, change)
    return SLICE, []


async def announce(events: EventCollector, change: ModeChange) -> None:
    """`scheduler.host_mode_changed` in the transaction of the change: the image pipeline's activation gate stops
    waiting for a host that is retired or serves baremetal tenants, and ops see the mode's history."""
    cause = f"{change.node_id}:{change.from_mode}:{change.to_mode}:{change.at.isoformat()}"
    await events.add(
        "scheduler.host_mode_changed",
        m.HostModeChanged(
            node_id=change.node_id,
            from_mode=change.from_mode,  # type: ignore[arg-type]  # one of MODES, checked by the aggregate
            to_mode=change.to_mode,  # type: ignore[arg-type]
            actor=change.actor,
            reason=change.reason[:500],
            changed_at=change.at,
        ),
        aggregate_id=change.node_id,
        event_id=derived_event_id(cause, "mode"),
    )
