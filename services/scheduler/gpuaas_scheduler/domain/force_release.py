"""Admin force-release of an allocation's claims, as pure rules.

The evidence that a VM may still hold a device is the scheduler's own record of the allocation's claims: the
slot statuses follow the allocation's lifecycle (placed -> reserved, provisioning, active, releasing), and a
slot leaves them only when the allocator reports the release or failure. While any slot is in one of them, a
provision or release task may be running or its VM may still run with the GPU passed through and the raw disk
attached; a whole-node claim means the machine may still be deployed to the tenant. Such a release is refused
unless the operator forces it. Either way the freed slots go to `cleanup_blocked` (the disk may hold tenant
data and nobody proved a wipe), never `available`: only a repair with a proof of the site's wipe frees them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from gpuaas_common.contract import SlotStatus

from .slots import allowed_from

# Slot statuses under which the allocation's VM may hold the slot's GPU and disk (or a task may be creating it).
VM_MAY_HOLD = frozenset({SlotStatus.RESERVED, SlotStatus.PROVISIONING, SlotStatus.ACTIVE, SlotStatus.RELEASING})
# Where force-release puts every slot it frees.
FORCED_TO = SlotStatus.CLEANUP_BLOCKED


@dataclass(frozen=True)
class ForceReleasePlan:
    holders: list[str]  # why a VM (or a tenant's machine) may still hold the devices
    refused: bool  # holders exist and the operator did not force
    block: list[str]  # slots to move to cleanup_blocked
    untouched: dict[str, str]  # slot -> status it stays in (already blocked, or not movable by the table)
    drain: list[str]  # nodes held whole: drained, their machine may still be the tenant's


def holders(claims: Iterable[Mapping[str, Any]]) -> list[str]:
    out = []
    for c in claims:
        if c.get("claim_kind") == "node_exclusive":
            out.append(f"node {c['node_id']} is held whole: the machine may still be deployed to the tenant")
        elif c.get("status") in VM_MAY_HOLD:
            out.append(f"slot {c['slot_id']} is {c['status']}: the allocation's VM may still hold its GPU and disk")
    return out


def plan_force_release(claims: Iterable[Mapping[str, Any]], force: bool) -> ForceReleasePlan:
    """What a force-release of these live claims does; `refused` when a VM may hold a device and force is off."""
    claims = list(claims)
    why = holders(claims)
    movable = allowed_from(FORCED_TO)
    block, untouched = [], {}
    for c in claims:
        if not c.get("slot_id"):
            continue
        if c.get("status") in movable:
            block.append(c["slot_id"])
        else:
            untouched[c["slot_id"]] = c.get("status") or "missing"
    drain = sorted({c["node_id"] for c in claims if c.get("claim_kind") == "node_exclusive"})
    return ForceReleasePlan(why, bool(why) and not force, sorted(block), untouched, drain)
