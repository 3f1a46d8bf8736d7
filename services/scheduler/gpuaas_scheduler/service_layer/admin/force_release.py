"""Admin force-release of an allocation's claims (domain/force_release.py has the rules and the aggregate).

Refused (409, with the evidence) while the scheduler's record says a VM may still hold the devices, unless
forced. A release that goes ahead frees the claims, moves the slots to `cleanup_blocked` with health `failed`,
drains a node held whole, and tells the allocator (placement.force_released) so the allocation ends."""

from __future__ import annotations

import uuid
from typing import Any

from gpuaas_common.contract import derived_event_id
from gpuaas_common.contract import messages as m
from gpuaas_common.logging import get_logger

from ...domain.force_release import FORCED_TO, ForceReleasePlan, ForceReleaseRefused, ForceReleaseSaved
from ..ports import AdminUnitOfWork
from ..slot_announcements import announce
from .models import AdminError, ForceReleaseIn

log = get_logger(__name__)


def _allocation_id(text: str) -> uuid.UUID:
    try:
        return uuid.UUID(text)
    except ValueError:
        raise AdminError(422, "invalid_allocation_id", "allocation_id is not a UUID") from None


def _refused(alloc: uuid.UUID, exc: ForceReleaseRefused) -> AdminError:
    return AdminError(
        409,
        "vm_may_hold_devices",
        f"allocation {alloc} may still hold its devices; release it normally, or force it (its slots then "
        "wait in cleanup_blocked for a repair with a proof of the site's wipe)",
        {"holders": exc.holders},
    )


async def force_release(uow: AdminUnitOfWork, allocation_id: str, body: ForceReleaseIn) -> dict[str, Any]:
    alloc = _allocation_id(allocation_id)
    release = await uow.repos.force_releases.get(alloc)
    if release is None:
        raise AdminError(404, "no_live_claims", f"allocation {alloc} holds no live claims")
    try:
        plan = release.release(actor=body.actor, reason=body.reason, force=body.force)
    except ForceReleaseRefused as exc:
        raise _refused(alloc, exc) from None
    saved = await uow.repos.force_releases.save(release)
    moved_nodes = {c.node_id for c in release.claims if c.slot_id in saved.slots_moved}
    for node_id in sorted(moved_nodes):
        await announce(uow.events, await uow.repos.slots.announcement(node_id, "force_release", body.actor))
    detail = {"force_release": body.reason, "forced": body.force, "holders": plan.holders}
    trail = {**detail, "slots": plan.block, "untouched": plan.untouched, "drained": plan.drain}
    await uow.repos.audit.record(body.actor, "allocation.force_release", str(alloc), body.reason, trail)
    await _tell_allocator(uow, alloc, body, plan, saved, release.node_ids)
    log.warning(
        "allocation_force_released",
        allocation_id=str(alloc),
        actor=body.actor,
        forced=body.force,
        holders=plan.holders,
        slots=plan.block,
        drained=plan.drain,
    )
    return _answer(alloc, body.force, plan, saved)


async def _tell_allocator(
    uow: AdminUnitOfWork,
    alloc: uuid.UUID,
    body: ForceReleaseIn,
    plan: ForceReleasePlan,
    saved: ForceReleaseSaved,
    node_ids: list[str],
) -> None:
    """placement.force_released: the allocator ends the allocation (one event per allocation, whatever retries)."""
    event = m.PlacementForceReleased(
        allocation_id=alloc,
        node_ids=node_ids,
        slot_ids=list(saved.slots_moved),
        actor=body.actor,
        reason=body.reason,
        forced=body.force,
        holders=plan.holders,
    )
    await uow.events.add(
        "placement.force_released",
        event,
        aggregate_id=str(alloc),
        event_id=derived_event_id(str(alloc), "force-released"),
    )


def _answer(alloc: uuid.UUID, forced: bool, plan: ForceReleasePlan, saved: ForceReleaseSaved) -> dict[str, Any]:
    return {
        "allocation_id": str(alloc),
        "forced": forced,
        "holders": plan.holders,
        "claims_released": saved.claims_ended,
        "slots": {slot_id: FORCED_TO for slot_id in saved.slots_moved},
        "untouched": plan.untouched,
        "drained_nodes": plan.drain,
    }
