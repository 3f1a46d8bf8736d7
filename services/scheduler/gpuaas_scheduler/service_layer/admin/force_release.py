"""Admin force-release of an allocation's claims (domain/force_release.py has the rules).

Refused (409, with the evidence) while the scheduler's record says a VM may still hold the devices, unless
forced. A release that goes ahead frees the claims, moves the slots to `cleanup_blocked` with health `failed`,
drains a node held whole, and tells the allocator (placement.force_released) so the allocation ends."""

from __future__ import annotations

import uuid

import asyncpg

from gpuaas_common.contract import derived_event_id
from gpuaas_common.contract import messages as m
from gpuaas_common.logging import get_logger
from gpuaas_common.outbox import EventCollector

from ...adapters import admin_nodes as audit_repo
from ...adapters import inventory as inv
from ...domain.force_release import FORCED_TO, plan_force_release
from ..slot_announcements import announce_nodes
from .models import AdminError, ForceReleaseIn

log = get_logger(__name__)


async def force_release(
    conn: asyncpg.Connection, events: EventCollector, allocation_id: str, body: ForceReleaseIn
) -> dict:
    try:
        alloc = uuid.UUID(allocation_id)
    except ValueError:
        raise AdminError(422, "invalid_allocation_id", "allocation_id is not a UUID") from None
    held = await inv.allocation_slots(conn, alloc)
    if not held:
        raise AdminError(404, "no_live_claims", f"allocation {alloc} holds no live claims")
    await inv.lock_nodes(conn, [r["node_id"] for r in held])
    held = await inv.allocation_slots(conn, alloc)  # as they are under the node locks
    if not held:
        raise AdminError(404, "no_live_claims", f"allocation {alloc} holds no live claims")
    plan = plan_force_release([dict(r) for r in held], body.force)
    if plan.refused:
        raise AdminError(
            409,
            "vm_may_hold_devices",
            f"allocation {alloc} may still hold its devices; release it normally, or force it (its slots then "
            "wait in cleanup_blocked for a repair with a proof of the site's wipe)",
            {"holders": plan.holders},
        )
    why = f"force-released by {body.actor}: {body.reason}"[:500]
    detail = {"force_release": body.reason, "forced": body.force, "holders": plan.holders}
    moved = await inv.move_slots(
        conn, plan.block, FORCED_TO, why, actor=body.actor, allocation_id=alloc, detail=detail, health=("failed", why)
    )
    for node_id in plan.drain:
        await inv.drain_node(conn, node_id, why, actor=body.actor)
    freed = await inv.release_claims(conn, alloc)
    node_ids = sorted({r["node_id"] for r in held})
    await inv.refresh_nodes(conn, node_ids)
    if moved:
        await announce_nodes(conn, events, {r["node_id"] for r in moved}, "force_release", body.actor)
    await audit_repo.audit(
        conn,
        body.actor,
        "allocation.force_release",
        str(alloc),
        body.reason,
        {**detail, "slots": plan.block, "untouched": plan.untouched, "drained": plan.drain},
    )
    await events.add(
        "placement.force_released",
        m.PlacementForceReleased(
            allocation_id=alloc,
            node_ids=node_ids,
            slot_ids=[r["slot_id"] for r in moved],
            actor=body.actor,
            reason=body.reason,
            forced=body.force,
            holders=plan.holders,
        ),
        aggregate_id=str(alloc),
        event_id=derived_event_id(str(alloc), "force-released"),
    )
    log.warning(
        "allocation_force_released",
        allocation_id=str(alloc),
        actor=body.actor,
        forced=body.force,
        holders=plan.holders,
        slots=plan.block,
        drained=plan.drain,
    )
    return {
        "allocation_id": str(alloc),
        "forced": body.force,
        "holders": plan.holders,
        "claims_released": len(freed),
        "slots": {r["slot_id"]: FORCED_TO for r in moved},
        "untouched": plan.untouched,
        "drained_nodes": plan.drain,
    }
