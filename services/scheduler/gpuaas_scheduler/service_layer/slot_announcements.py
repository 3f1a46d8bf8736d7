"""`scheduler.slots_changed`: a host's slots announced in the transaction that changed them outside placement.

Announced: approval (slots created, or rewritten from a candidate), retire, disable, repair, a force-release, the
claim audit's settlement, and an allocation's end that left a slot `cleanup_blocked` (a refused or missing wipe
proof). Not announced: a claim, and the end of one that gives a healthy slot back; the lifecycle events carry those,
and placement is the hot path. Each announcement carries every slot of the host and the host's next number, so a
reader keeps the newest whatever else it missed."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from gpuaas_common.contract import messages as m
from gpuaas_common.outbox import EventCollector, OutboxWriter

from ..adapters.repository import SlotRepository
from .ports import SlotAnnouncements

TYPE = "scheduler.slots_changed"


async def announce(events: EventCollector | OutboxWriter, change: m.SlotsChanged | None) -> None:
    """Raise the announcement in the unit of work (nothing for a node the scheduler does not have)."""
    if change is not None:
        await events.add(TYPE, change, aggregate_id=change.node_id)


async def announce_nodes(
    slots: SlotAnnouncements | Any,
    events: EventCollector | OutboxWriter,
    node_ids: Iterable[str],
    cause: m.SlotsChangeCause,
    actor: str,
) -> None:
    """Each node's slots as the caller's transaction leaves them, in node id order (the order its locks go).
    `slots`: the unit of work's `repos.slots`, or (the admin layer's callers, until they move to ports) a
    connection to wrap in the same repository."""
    if not hasattr(slots, "announcement"):
        slots = SlotRepository(slots)
    for node_id in sorted(set(node_ids)):
        await announce(events, await slots.announcement(node_id, cause, actor))
