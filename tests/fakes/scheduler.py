"""The scheduler's claims, slots and nodes repositories in memory (gpuaas_scheduler.adapters.repository's
ClaimRepository, SlotRepository and NodeRepository): one `World` of slots, claims, the transition log and the
node flags, as the scheduler's tables hold them."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from gpuaas_common.contract import messages as m
from gpuaas_scheduler.domain.node_claims import HeldClaim, NodeClaims, NodeDrained, SlotsMoved
from gpuaas_scheduler.domain.slots import movable_from


@dataclass
class Slot:
    slot_id: str
    node_id: str
    status: str
    nvme_by_id: str
    health: str = "healthy"
    wipe_policy: str = "blkdiscard"  # the column's default
    health_detail: str | None = None
    reason: str | None = None
    profile: str = "h200_1g"


@dataclass
class Claim:
    allocation_id: uuid.UUID
    node_id: str
    slot_id: str | None
    status: str = "held"

    @property
    def kind(self) -> str:
        return "slot" if self.slot_id else "node_exclusive"


@dataclass
class World:
    """Slots, claims, the transition log and the node flags, as the scheduler's tables hold them."""

    nodes: set[str] = field(default_factory=set)
    slots: dict[str, Slot] = field(default_factory=dict)
    claims: list[Claim] = field(default_factory=list)
    log: list[tuple[str, str, str, uuid.UUID | None, Any]] = field(default_factory=list)  # slot, from, to, alloc
    drained: dict[str, str] = field(default_factory=dict)
    refreshed: list[list[str]] = field(default_factory=list)
    announced: dict[str, int] = field(default_factory=dict)  # node -> its last announcement's number

    def live(self, alloc: uuid.UUID) -> list[Claim]:
        return sorted(
            (c for c in self.claims if c.allocation_id == alloc and c.status != "released"),
            key=lambda c: c.slot_id or "",
        )

    def move(self, slot_ids, status, reason, only_from, alloc, detail=None, health=None) -> int:
        """Only the moves domain/slots.py allows, as the Postgres repository's statements."""
        only_from = movable_from(status, only_from)
        moved = 0
        for slot_id in sorted(slot_ids):
            slot = self.slots[slot_id]
            if slot.status in only_from:
                self.log.append((slot_id, slot.status, status, alloc, detail))
                slot.status = status
                if health:
                    slot.health = health[0]
                    slot.health_detail = health[1]
                slot.reason = reason
                moved += 1
        return moved


class FakeClaims:
    """Same surface as adapters.repository.ClaimRepository."""

    def __init__(self, world: World) -> None:
        self.world = world
        self.locked: list[uuid.UUID] = []

    async def lock_allocation(self, allocation_id: uuid.UUID) -> None:
        self.locked.append(allocation_id)

    async def load(self, allocation_id: uuid.UUID, *, log_reached: str | None = None) -> NodeClaims:
        rows = []
        for c in self.world.live(allocation_id):
            slot = self.world.slots.get(c.slot_id or "")
            reached = slot is not None and any(
                s == slot.slot_id and to == log_reached and a == allocation_id for s, _f, to, a, _d in self.world.log
            )
            rows.append(
                HeldClaim(
                    c.node_id,
                    c.kind,
                    c.slot_id,
                    slot.status if slot else None,
                    slot.nvme_by_id if slot else None,
                    slot.wipe_policy if slot else None,
                    None,
                    reached,
                )
            )
        return NodeClaims(str(allocation_id), tuple(rows))

    async def save(self, claims: NodeClaims) -> int:
        alloc = uuid.UUID(claims.allocation_id)
        for change in claims.changes:
            if isinstance(change, SlotsMoved):
                self.world.move(
                    change.slot_ids, change.status, change.reason, change.only_from, alloc, change.detail, change.health
                )
            elif isinstance(change, NodeDrained):
                self.world.drained[change.node_id] = change.reason
        claims.changes.clear()
        if not claims.released:
            return 0
        ended = self.world.live(alloc)
        for c in ended:
            c.status = "released"
        return len(ended)


class FakeSlots:
    """Same surface as adapters.repository.SlotRepository."""

    def __init__(self, world: World) -> None:
        self.world = world

    async def move_for_allocation(self, allocation_id: uuid.UUID, status: str, only_from: tuple[str, ...]) -> int:
        ids = [c.slot_id for c in self.world.live(allocation_id) if c.slot_id]
        return self.world.move(ids, status, None, movable_from(status, only_from), allocation_id)

    async def statuses(self, allocation_id: uuid.UUID) -> dict[str, str]:
        return {c.slot_id: self.world.slots[c.slot_id].status for c in self.world.live(allocation_id) if c.slot_id}

    async def announcement(self, node_id: str, cause: Any, actor: str) -> m.SlotsChanged | None:
        if node_id not in self.world.nodes:
            return None  # no such node
        generation = self.world.announced[node_id] = self.world.announced.get(node_id, 0) + 1
        mine = sorted((s for s in self.world.slots.values() if s.node_id == node_id), key=lambda s: s.slot_id)
        states = [
            m.SlotState(
                slot_id=s.slot_id,
                status=s.status,  # type: ignore[arg-type]
                status_reason=s.reason,
                health_state=s.health,  # type: ignore[arg-type]
                health_detail=s.health_detail,
                profile=s.profile,
                nvme_by_id=s.nvme_by_id,
                updated_at=datetime.now(timezone.utc),
            )
            for s in mine
        ]
        return m.SlotsChanged(node_id=node_id, generation=generation, cause=cause, actor=actor[:128], slots=states)


class FakeNodes:
    """adapters.repository.NodeRepository's `refresh`, recorded: the capacity summary is placement's."""

    def __init__(self, world: World) -> None:
        self.world = world

    async def refresh(self, node_ids) -> None:
        self.world.refreshed.append(list(node_ids))


@dataclass
class FakeRepositories:
    nodes: FakeNodes
    slots: FakeSlots
    claims: FakeClaims
    hosts: Any = None
