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
from dataclasses import asdict, dataclass, field
from typing import Any

from gpuaas_common.contract import SlotStatus

from .node_claims import Change, HeldClaim, NodeDrained, SlotsMoved
from .slots import allowed_from, movable_from

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


class ForceReleaseRefused(Exception):
    """A VM (or a tenant's machine) may still hold the devices and the operator did not force."""

    def __init__(self, holders: list[str]) -> None:
        super().__init__("; ".join(holders))
        self.holders = holders


@dataclass(frozen=True)
class ForceReleaseSaved:
    """What the repository wrote: the claims it ended and the slots it moved to `cleanup_blocked`."""

    claims_ended: int
    slots_moved: tuple[str, ...]


@dataclass
class ForceRelease:
    """One allocation's live claims as a force-release finds them under their nodes' locks (the aggregate:
    `release` decides and records; the repository writes the changes and ends the claims)."""

    allocation_id: str
    claims: tuple[HeldClaim, ...]
    changes: list[Change] = field(default_factory=list)
    released: bool = False

    @property
    def node_ids(self) -> list[str]:
        return sorted({c.node_id for c in self.claims})

    def release(self, *, actor: str, reason: str, force: bool) -> ForceReleasePlan:
        """Block every slot the table lets go to `cleanup_blocked` (its health failed), drain every node held
        whole, end the claims; raises ForceReleaseRefused, recording nothing, when a VM may hold a device and
        `force` is off."""
        plan = plan_force_release([asdict(c) for c in self.claims], force)
        if plan.refused:
            raise ForceReleaseRefused(plan.holders)
        why = f"force-released by {actor}: {reason}"[:500]
        detail = {"force_release": reason, "forced": force, "holders": plan.holders}
        if plan.block:
            only_from = tuple(movable_from(FORCED_TO, None))
            self.changes.append(
                SlotsMoved(tuple(plan.block), FORCED_TO, why, only_from, detail, ("failed", why), actor=actor)
            )
        self.changes += [NodeDrained(node_id, why, actor=actor) for node_id in plan.drain]
        self.released = True
        return plan
