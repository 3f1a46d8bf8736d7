"""The scheduler's repositories in memory (gpuaas_scheduler.adapters.repository's ClaimRepository, SlotRepository,
NodeRepository, AuditRepository and adapters/hosts.py's HostRepository): one `World` of node rows, slots, claims,
the transition log, the wipe asks and the admin trail, as the scheduler's tables hold them."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from gpuaas_common.contract import messages as m
from gpuaas_scheduler.domain.host import Change, Drained, Host, HostSlot, ModeChanged, Undrained, WipeAsked
from gpuaas_scheduler.domain.host_mode import HostFacts, ModeChange
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
    approved_at: datetime | None = None
    gpu_pci_address: str | None = None
    fabric_vf_pci_address: str | None = None


@dataclass
class Node:
    """A node row's columns that the `Host` aggregate reads and writes."""

    mode: str = "slice"
    accepts_slices: bool = False  # from the MAAS tags
    accepts_baremetal: bool = False
    parity_failures: int | None = None
    topology_reported: bool = False
    evidence_reset_at: datetime | None = None
    draining: bool = False
    maintenance: bool = False
    drain_reason: str | None = None
    drained_by: str | None = None
    maintenance_reason: str | None = None
    history: list[ModeChange] = field(default_factory=list)


@dataclass
class WipeAsk:
    task_id: str
    slot_id: str
    node_id: str
    device: str
    policy: str
    cause: str
    why: str
    requested_by: str
    outcome: str | None = None  # None: open


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
    rows: dict[str, Node] = field(default_factory=dict)  # node -> its row, default columns until set
    wipes: list[WipeAsk] = field(default_factory=list)
    audit: list[tuple[str, str, str, str | None, Any]] = field(default_factory=list)

    def row(self, node_id: str) -> Node:
        return self.rows.setdefault(node_id, Node())

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


class FakeHosts:
    """Same surface as adapters.hosts.HostRepository: the facts as its statements compute them."""

    def __init__(self, world: World) -> None:
        self.world = world
        self.locked: list[str] = []

    def _facts(self, node_id: str) -> HostFacts:
        row = self.world.row(node_id)
        mine = [s for s in self.world.slots.values() if s.node_id == node_id and s.status != "retired"]
        reset = row.evidence_reset_at
        return HostFacts(
            node_id=node_id,
            mode=row.mode,
            accepts_slices=row.accepts_slices,
            accepts_baremetal=row.accepts_baremetal,
            live_claims=sum(1 for c in self.world.claims if c.node_id == node_id and c.status != "released"),
            unretired_slots=len(mine),
            parity_failures=row.parity_failures,
            rediscovered=row.topology_reported,
            reapproved_slots=sum(
                1
                for s in mine
                if s.status in ("available", "awaiting_wipe")
                and s.approved_at is not None
                and (reset is None or s.approved_at >= reset)
            ),
            stale_slots=sum(1 for s in mine if reset is not None and (s.approved_at is None or s.approved_at < reset)),
        )

    def _slot(self, s: Slot) -> HostSlot:
        return HostSlot(
            s.slot_id,
            s.status,
            s.nvme_by_id,
            s.wipe_policy,
            any(c.slot_id == s.slot_id and c.status != "released" for c in self.world.claims),
            any(w.slot_id == s.slot_id and w.outcome is None for w in self.world.wipes),
            s.gpu_pci_address,
            s.fabric_vf_pci_address,
        )

    async def get(self, node_id: str) -> Host | None:
        if node_id not in self.world.nodes:
            return None
        self.locked.append(node_id)
        row = self.world.row(node_id)
        slots = tuple(
            self._slot(s) for s in sorted(self.world.slots.values(), key=lambda s: s.slot_id) if s.node_id == node_id
        )
        return Host(
            self._facts(node_id),
            datetime.now(timezone.utc),
            draining=row.draining,
            maintenance=row.maintenance,
            slots=slots,
        )

    async def save(self, host: Host) -> list[Change]:
        saved, host.changes = list(host.changes), []
        moved = 0
        for ch in saved:
            if isinstance(ch, ModeChanged):
                self._change_mode(ch.change)
            elif isinstance(ch, Drained):
                row = self.world.row(ch.node_id)
                row.draining, row.drain_reason, row.drained_by = True, ch.reason, ch.actor
                if ch.maintenance:
                    row.maintenance, row.maintenance_reason = True, ch.reason
            elif isinstance(ch, Undrained):
                row = self.world.row(ch.node_id)
                row.draining = row.maintenance = False
                row.drain_reason = row.drained_by = row.maintenance_reason = None
            elif isinstance(ch, WipeAsked):
                self._ask(ch)
            elif isinstance(ch, SlotsMoved):
                moved += self.world.move(ch.slot_ids, ch.status, ch.reason, ch.only_from, None, ch.detail)
        if moved:
            self.world.refreshed.append([host.node_id])
        return saved

    def _change_mode(self, ch: ModeChange) -> None:
        row = self.world.row(ch.node_id)
        row.mode = ch.to_mode
        if ch.resets_evidence:
            row.parity_failures, row.topology_reported, row.evidence_reset_at = None, False, ch.at
        row.history.append(ch)

    def _ask(self, ch: WipeAsked) -> None:
        ids = {slot_id for slot_id, _d, _p in ch.slots}
        for w in self.world.wipes:
            if w.slot_id in ids and w.outcome is None:
                w.outcome = "superseded"
        self.world.wipes += [
            WipeAsk(ch.task_id, s, ch.node_id, d, p, ch.cause, ch.why[:2000], ch.actor) for s, d, p in ch.slots
        ]


class FakeAudit:
    """adapters.repository.AuditRepository: the admin trail's rows, in order."""

    def __init__(self, world: World) -> None:
        self.world = world

    async def record(self, actor: str, action: str, target: str, reason: str | None, detail: Any = None) -> None:
        self.world.audit.append((actor, action, target, reason, detail))


@dataclass
class FakeRepositories:
    nodes: FakeNodes
    slots: FakeSlots
    claims: FakeClaims
    hosts: FakeHosts | None = None
    audit: FakeAudit | None = None


def fake_repositories(world: World) -> FakeRepositories:
    return FakeRepositories(FakeNodes(world), FakeSlots(world), FakeClaims(world), FakeHosts(world), FakeAudit(world))
