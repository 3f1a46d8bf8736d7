"""The scheduler's repositories in memory (gpuaas_scheduler.adapters.repository's ClaimRepository, SlotRepository,
NodeRepository, AuditRepository, adapters/hosts.py's HostRepository, and the evidence's: EvidenceRepository,
DriftRepository, SlotWipeRepository, NodeActionRepository, and adapters/admin.py's inventory admin repositories):
one `World` of node rows, slots, claims, the transition log, the wipe asks, the asks of hosts, waivers, quotas,
drift, site wipe policies and the admin trail, as the scheduler's tables hold them."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from gpuaas_common.contract import messages as m
from gpuaas_scheduler.domain.drift import DriftKey
from gpuaas_scheduler.domain.force_release import ForceRelease, ForceReleaseSaved
from gpuaas_scheduler.domain.host import (
    Change,
    Drained,
    DriftRecorded,
    EvidenceTimes,
    Host,
    HostSlot,
    ModeChanged,
    ParityRecorded,
    TopologyRecorded,
    Undrained,
    WipeAsked,
)
from gpuaas_scheduler.domain.host_mode import Host as HostModes
from gpuaas_scheduler.domain.host_mode import HostFacts, ModeChange
from gpuaas_scheduler.domain.node_claims import HeldClaim, NodeClaims, NodeDrained, SlotsMoved
from gpuaas_scheduler.domain.slots import movable_from
from gpuaas_scheduler.domain.steering import OpenAsk, SteerFacts


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
    mac: str | None = None
    private_ip: str | None = None
    fabric_claim_mode: str | None = None
    emulated: bool = False


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
    # The host's evidence as its reports left it.
    kind: str = "slice_host"
    maas_system_id: str | None = None
    parity_reported_at: datetime | None = None
    parity_detail: dict[str, Any] | None = None
    topology_reported_at: datetime | None = None
    topology: TopologyRecorded | None = None
    drift_reported_at: datetime | None = None
    preflight: tuple[str, datetime, str] | None = None  # status, reported at, operation
    # What registration declares (admin upsert), and who registered it (the mode history's first row).
    declared: dict[str, Any] = field(default_factory=dict)
    registered: tuple[str, str, str] | None = None  # actor, reason, mode


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
    tenant_id: str = "t"
    gpus: int = 1

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
    candidates: dict[str, tuple[Any, ...]] = field(default_factory=dict)  # id -> row, unapproved
    drift: dict[str, dict[DriftKey, str]] = field(default_factory=dict)  # node -> key -> status
    drift_reports: list[tuple[str, str, datetime]] = field(default_factory=list)  # event, node, checked at
    preflights: dict[str, str | None] = field(default_factory=dict)  # operation -> node
    images: dict[tuple[str, str], tuple[str, bool, datetime]] = field(default_factory=dict)  # status, ok, at
    asks: dict[str, dict[str, Any]] = field(default_factory=dict)  # action id -> node_actions row
    waivers: list[dict[str, Any]] = field(default_factory=list)
    quotas: dict[str, dict[str, Any]] = field(default_factory=dict)
    drift_rows: list[dict[str, Any]] = field(default_factory=list)  # node_drift's rows, as the admin lists them
    site_policies: dict[str, dict[str, Any]] = field(default_factory=dict)
    regions: dict[str, str] = field(default_factory=dict)  # node -> region, "default" until set

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
            evidence=EvidenceTimes(
                row.parity_reported_at, row.topology_reported_at, row.drift_reported_at, row.evidence_reset_at
            ),
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
            else:
                self._evidence(ch)
        if moved:
            self.world.refreshed.append([host.node_id])
        return saved

    def _evidence(self, ch: ParityRecorded | TopologyRecorded | DriftRecorded) -> None:
        row = self.world.row(ch.node_id)
        if isinstance(ch, ParityRecorded):
            row.parity_failures, row.parity_detail, row.parity_reported_at = ch.failures, ch.detail, ch.checked_at
        elif isinstance(ch, TopologyRecorded):
            row.topology_reported, row.topology_reported_at, row.topology = True, ch.discovered_at, ch
            for cid in [c for c, r in self.world.candidates.items() if r[1] == ch.node_id]:
                del self.world.candidates[cid]
            self.world.candidates.update({r[0]: r for r in ch.candidates})
        else:
            self._drift(ch)

    def _drift(self, ch: DriftRecorded) -> None:
        self.world.row(ch.node_id).drift_reported_at = ch.checked_at
        self.world.drift_reports.append((ch.event_id, ch.node_id, ch.checked_at))
        mine = [r for r in self.world.drift_reports if r[1] == ch.node_id]
        for gone in sorted(mine, key=lambda r: (r[2], r[0]), reverse=True)[ch.keep :]:
            self.world.drift_reports.remove(gone)
        items = self.world.drift.setdefault(ch.node_id, {})
        items.update({k: "resolved" for k in ch.change.resolve})
        items.update({k: "open" for k in ch.change.open})

    def _change_mode(self, ch: ModeChange) -> None:
        row = self.world.row(ch.node_id)
        row.mode = ch.to_mode
        if ch.resets_evidence:
            row.parity_failures, row.topology_reported, row.evidence_reset_at = None, False, ch.at
            row.parity_reported_at = row.topology_reported_at = row.parity_detail = row.topology = None
            self.world.candidates = {c: r for c, r in self.world.candidates.items() if r[1] != ch.node_id}
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


# --- evidence, steering, drift, wipes, walks (issue 39) -------------------------------------------------------


class FakeEvidence:
    """Same surface as adapters.evidence.EvidenceRepository."""

    def __init__(self, world: World) -> None:
        self.world = world

    async def node_for_machine(self, system_id: str, node_id: str | None) -> str | None:
        by_machine = [n for n, r in self.world.rows.items() if r.maas_system_id == system_id and n in self.world.nodes]
        if by_machine:
            return by_machine[0]
        return node_id if node_id in self.world.nodes else None

    async def insert_slice_preflight(self, node_id: str | None, row: dict[str, Any]) -> bool:
        if row["operation_id"] in self.world.preflights:
            return False
        self.world.preflights[row["operation_id"]] = node_id
        return True

    async def update_preflight(self, node_id: str, status: str, reported_at: datetime, operation_id: str) -> bool:
        row = self.world.row(node_id)
        if row.preflight is not None and row.preflight[1] > reported_at:
            return False
        row.preflight = (status, reported_at, operation_id)
        return True

    async def upsert_image_readiness(
        self, node_id: str, slug: str, status: str, digest: str | None, schedulable: bool, reported_at: datetime
    ) -> bool:
        held = self.world.images.get((node_id, slug))
        if held is not None and held[2] > reported_at:
            return False
        self.world.images[(node_id, slug)] = (status, schedulable, reported_at)
        return True


class FakeDrift:
    """Same surface as adapters.drift.DriftRepository."""

    def __init__(self, world: World) -> None:
        self.world = world

    async def node_slots(self, node_id: str) -> list[dict[str, Any]]:
        mine = sorted((s for s in self.world.slots.values() if s.node_id == node_id), key=lambda s: s.slot_id)
        fields = ("gpu_pci_address", "fabric_vf_pci_address", "nvme_by_id", "mac", "private_ip")
        return [{"slot_id": s.slot_id, **{f: getattr(s, f) for f in fields}} for s in mine]

    async def held_keys(self, node_id: str) -> list[DriftKey]:
        return [k for k, status in self.world.drift.get(node_id, {}).items() if status != "resolved"]


class FakeWipes:
    """Same surface as adapters.slot_wipes.SlotWipeRepository; each slot's effective policy is its own."""

    def __init__(self, world: World) -> None:
        self.world = world

    async def lock_node(self, node_id: str) -> bool:
        return node_id in self.world.nodes

    async def open_asks(self, task_id: str, node_id: str, slots: Any, *, cause: str, why: str, actor: str) -> None:
        ids = {s["slot_id"] for s in slots}
        for w in self.world.wipes:
            if w.slot_id in ids and w.outcome is None:
                w.outcome = "superseded"
        self.world.wipes += [
            WipeAsk(task_id, s["slot_id"], node_id, s["nvme_by_id"], s["wipe_policy"], cause, why[:2000], actor)
            for s in slots
        ]

    def _claimed(self, slot_id: str) -> bool:
        return any(c.slot_id == slot_id and c.status != "released" for c in self.world.claims)

    async def open_asks_of_task(self, node_id: str, task_id: str) -> list[dict[str, Any]]:
        out = []
        for w in sorted(self.world.wipes, key=lambda w: w.slot_id):
            slot = self.world.slots.get(w.slot_id)
            if w.task_id != task_id or w.node_id != node_id or w.outcome is not None or slot is None:
                continue
            if slot.node_id != node_id:
                continue
            out.append(
                {
                    "task_id": w.task_id,
                    "slot_id": w.slot_id,
                    "device": w.device,
                    "policy": w.policy,
                    "cause": w.cause,
                    "status": slot.status,
                    "nvme_by_id": slot.nvme_by_id,
                    "node_id": slot.node_id,
                    "gpu_pci_address": slot.gpu_pci_address,
                    "mac": slot.mac,
                    "private_ip": slot.private_ip,
                    "fabric_claim_mode": slot.fabric_claim_mode,
                    "fabric_vf_pci_address": slot.fabric_vf_pci_address,
                    "emulated": slot.emulated,
                    "destructive_wipe_policy": slot.wipe_policy,
                    "wipe_policy_site": None,
                    "claimed": self._claimed(w.slot_id),
                }
            )
        return out

    async def close(self, task_id: str, slot_id: str, *, outcome: str, verdict: str, report: Any) -> None:
        for w in self.world.wipes:
            if w.task_id == task_id and w.slot_id == slot_id and w.outcome is None:
                w.outcome = outcome

    async def lock_overdue(self, older_than_s: float, statuses: Any, limit: int) -> list[dict[str, Any]]:
        # Every open ask counts as overdue here: the fake has no clock to age them by.
        rows = []
        for w in sorted(self.world.wipes, key=lambda w: (w.node_id, w.slot_id)):
            slot = self.world.slots[w.slot_id]
            if w.outcome is None and slot.status in statuses and not self._claimed(w.slot_id):
                rows.append(
                    {
                        "task_id": w.task_id,
                        "slot_id": w.slot_id,
                        "node_id": w.node_id,
                        "cause": w.cause,
                        "status": slot.status,
                        "nvme_by_id": slot.nvme_by_id,
                        "wipe_policy": slot.wipe_policy,
                    }
                )
        return rows[:limit]

    async def expire(self, task_id: str, slot_ids: Any, verdict: str) -> None:
        for w in self.world.wipes:
            if w.task_id == task_id and w.slot_id in slot_ids and w.outcome is None:
                w.outcome = "expired"

    async def move_slot(
        self, slot_id: str, to: str, reason: str | None, *, actor: str, only_from: Any, detail: Any, health: Any
    ) -> None:
        self.world.move([slot_id], to, reason, tuple(only_from), None, detail, health)


class FakeAsks:
    """Same surface as adapters.node_actions.NodeActionRepository."""

    def __init__(self, world: World) -> None:
        self.world = world

    def _open(self, node_id: str, kind: str) -> dict[str, Any] | None:
        return next(
            (
                a
                for a in self.world.asks.values()
                if a["node_id"] == node_id and a["kind"] == kind and a["status"] == "requested"
            ),
            None,
        )

    async def facts(self, node_id: str, kind: str) -> SteerFacts | None:
        if node_id not in self.world.nodes:
            return None
        row = self.world.row(node_id)
        a = self._open(node_id, kind)
        return SteerFacts(
            node_id=node_id,
            node_kind=row.kind,
            mode=row.mode,
            maas_system_id=row.maas_system_id,
            live_claims=sum(1 for c in self.world.claims if c.node_id == node_id and c.status != "released"),
            takes_placements=row.mode == "slice" and not row.draining and not row.maintenance,
            open_ask=OpenAsk(a["action_id"], a["actor"], a["requested_at"], a["deadline"]) if a else None,
        )

    async def insert(
        self, action_id: str, node_id: str, kind: str, actor: str, reason: str, deadline_s: float
    ) -> dict[str, Any] | None:
        if self._open(node_id, kind) is not None:
            return None
        now = datetime.now(timezone.utc)
        row = {
            "action_id": action_id,
            "node_id": node_id,
            "kind": kind,
            "actor": actor,
            "reason": reason,
            "status": "requested",
            "outcome": None,
            "result": {},
            "requested_at": now,
            "deadline": now,
            "finished_at": None,
        }
        self.world.asks[action_id] = row
        return dict(row)

    async def kind_of(self, action_id: str, node_id: str) -> str | None:
        a = self.world.asks.get(action_id)
        return a["kind"] if a and a["node_id"] == node_id else None

    async def record_part(
        self, action_id: str, node_id: str, part: str, value: dict[str, Any], settle: tuple[str, str] | None
    ) -> str | None:
        a = self.world.asks.get(action_id)
        if a is None or a["node_id"] != node_id:
            return None
        a["result"] = {**a["result"], part: value}
        if settle and a["status"] == "requested":
            a["status"], a["outcome"] = settle
        return str(a["kind"])

    async def get(self, action_id: str) -> dict[str, Any] | None:
        a = self.world.asks.get(action_id)
        return dict(a) if a else None

    async def expire_overdue(self, outcomes: dict[str, str]) -> list[dict[str, Any]]:
        return []  # no clock: nothing is ever past its deadline here

    async def due_for_parity(self, modes: tuple[str, ...], interval_s: float | None, limit: int) -> list[str]:
        return []


# --- admin: nodes, quotas, drift, wipe, force release (issue 39) ---


def _now() -> datetime:
    return datetime.now(timezone.utc)


class FakeAdminNodes:
    """Same surface as adapters.admin.AdminNodeRepository; a node's view carries the columns the World keeps."""

    def __init__(self, world: World) -> None:
        self.world = world
        self.locked: list[str] = []

    async def lock(self, node_id: str) -> bool:
        if node_id not in self.world.nodes:
            return False
        self.locked.append(node_id)
        return True

    async def lock_mode(self, node_id: str) -> str | None:
        return self.world.row(node_id).mode if await self.lock(node_id) else None

    async def register(self, node: dict[str, Any]) -> None:
        node_id = node["node_id"]
        row = self.world.row(node_id)
        if node_id not in self.world.nodes:
            self.world.nodes.add(node_id)
            row.mode = node["mode"]
        row.declared = {k: v for k, v in node.items() if k not in ("node_id", "mode")}
        self.world.regions[node_id] = node["region"]

    async def record_created(self, node_id: str, actor: str, reason: str) -> None:
        row = self.world.row(node_id)
        row.registered = (actor, reason, row.mode)

    async def listing(self, region: str | None, sku: str | None) -> list[dict[str, Any]]:
        views = [await self.view(n) for n in sorted(self.world.nodes)]
        return [
            v for v in views if v and (region is None or v["region"] == region) and (sku is None or v["sku"] == sku)
        ]

    async def view(self, node_id: str) -> dict[str, Any] | None:
        if node_id not in self.world.nodes:
            return None
        r = self.world.row(node_id)
        return {
            "node_id": node_id,
            **r.declared,
            "region": self.world.regions.get(node_id, "default"),
            "mode": r.mode,
            "draining": r.draining,
            "drain_reason": r.drain_reason,
            "maintenance": r.maintenance,
        }

    async def live_claims(self, node_id: str) -> list[dict[str, Any]]:
        return [
            {"allocation_id": c.allocation_id, "slot_id": c.slot_id, "claim_kind": c.kind, "status": c.status}
            for c in self.world.claims
            if c.node_id == node_id and c.status != "released"
        ]

    async def mode_history(self, node_id: str) -> list[dict[str, Any]]:
        r = self.world.row(node_id)
        rows = []
        if r.registered is not None:
            actor, reason, mode = r.registered
            rows.append({"from_mode": None, "to_mode": mode, "actor": actor, "reason": reason})
        rows += [
            {"from_mode": h.from_mode, "to_mode": h.to_mode, "actor": h.actor, "reason": h.reason} for h in r.history
        ]
        return rows[::-1]

    async def mode_record(self, node_id: str) -> dict[str, Any] | None:
        if node_id not in self.world.nodes:
            return None
        r = self.world.row(node_id)
        last = r.history[-1] if r.history else None
        by, why = (last.actor, last.reason) if last else (r.registered or (None, None))[:2]
        return {"mode_changed_by": by, "mode_reason": why}

    async def modes(self, node_id: str) -> HostModes | None:
        return HostModes(FakeHosts(self.world)._facts(node_id)) if node_id in self.world.nodes else None

    async def waivers(self, node_id: str) -> list[dict[str, Any]]:
        mine = [w for w in self.world.waivers if w["node_id"] == node_id]
        return [{**w, "active": w["expires_at"] > _now()} for w in mine[::-1]]

    async def add_waiver(
        self, node_id: str, gate: str, actor: str, reason: str, expires_at: datetime
    ) -> dict[str, Any]:
        row = {
            "waiver_id": len(self.world.waivers) + 1,
            "node_id": node_id,
            "gate": gate,
            "actor": actor,
            "reason": reason,
            "expires_at": expires_at,
            "created_at": _now(),
        }
        self.world.waivers.append(row)
        return dict(row)

    async def actions(self, node_id: str) -> list[dict[str, Any]]:
        return []  # the asks are steering's (node_actions), which no admin fake records

    async def walks(self, node_id: str, limit: int) -> list[dict[str, Any]]:
        return []

    async def now(self) -> datetime:
        return _now()


class FakeQuotas:
    """Same surface as adapters.admin.QuotaRepository."""

    def __init__(self, world: World) -> None:
        self.world = world

    async def set(self, tenant_id: str, max_gpus: int, *, actor: str, reason: str) -> None:
        self.world.quotas[tenant_id] = {
            "tenant_id": tenant_id,
            "max_gpus": max_gpus,
            "updated_by": actor,
            "reason": reason,
            "updated_at": _now(),
        }

    async def get(self, tenant_id: str) -> dict[str, Any] | None:
        row = self.world.quotas.get(tenant_id)
        return dict(row) if row else None

    async def gpus_in_use(self, tenant_id: str) -> int:
        return sum(c.gpus for c in self.world.claims if c.tenant_id == tenant_id and c.status != "released")


class FakeDriftLog:
    """Same surface as adapters.admin.DriftLogRepository: node_drift's rows, the node's flag computed from them."""

    def __init__(self, world: World) -> None:
        self.world = world

    async def node_flags(self, node_id: str) -> dict[str, Any] | None:
        if node_id not in self.world.nodes:
            return None
        node_open = any(d["slot_id"] is None and d["status"] == "open" for d in self._mine(node_id))
        return {"drift_open": node_open, "drift_reported_at": self.world.row(node_id).drift_reported_at}

    def _mine(self, node_id: str) -> list[dict[str, Any]]:
        return [d for d in self.world.drift_rows if d["node_id"] == node_id]

    async def items(self, node_id: str, *, include_resolved: bool) -> list[dict[str, Any]]:
        rows = [dict(d) for d in self._mine(node_id) if include_resolved or d["status"] != "resolved"]
        return sorted(rows, key=lambda d: (d["status"] == "resolved", d["first_reported_at"], d["drift_id"]))

    async def by_id(self, node_id: str, drift_ids: list[int]) -> list[dict[str, Any]]:
        return [dict(d) for d in self._mine(node_id) if d["drift_id"] in drift_ids]

    async def acknowledge(
        self, node_id: str, drift_ids: list[int] | None, actor: str, reason: str
    ) -> list[dict[str, Any]]:
        changed = []
        for d in self._mine(node_id):
            if d["status"] == "open" and (drift_ids is None or d["drift_id"] in drift_ids):
                d.update(status="acknowledged", acknowledged_at=_now(), acknowledged_by=actor, ack_reason=reason)
                changed.append(dict(d))
        if changed:
            self.world.refreshed.append([node_id])
        return changed


class FakeWipePolicies:
    """Same surface as adapters.admin.WipePolicyRepository."""

    def __init__(self, world: World) -> None:
        self.world = world
        self.locked: list[str] = []

    async def site(self, region: str) -> dict[str, Any] | None:
        row = self.world.site_policies.get(region)
        return dict(row) if row else None

    async def lock_region(self, region: str) -> None:
        self.locked.append(region)

    async def set_site(self, region: str, policy: str, *, actor: str, reason: str) -> list[str]:
        self.world.site_policies[region] = {
            "region": region,
            "destructive_wipe_policy": policy,
            "set_by": actor,
            "reason": reason,
            "updated_at": _now(),
        }
        changed = []
        for s in self.world.slots.values():
            if self.world.regions.get(s.node_id, "default") == region and s.wipe_policy != policy:
                s.wipe_policy = policy
                changed.append(s.slot_id)
        return sorted(changed)

    async def claimed(self, slot_ids: list[str]) -> list[str]:
        return sorted({c.slot_id for c in self.world.claims if c.slot_id in slot_ids and c.status != "released"})


class FakeForceReleases:
    """Same surface as adapters.admin.ForceReleaseRepository."""

    def __init__(self, world: World) -> None:
        self.world = world
        self.locked: list[str] = []

    async def get(self, allocation_id: uuid.UUID) -> ForceRelease | None:
        claims = (await FakeClaims(self.world).load(allocation_id)).claims
        if not claims:
            return None
        self.locked += sorted({c.node_id for c in claims})
        return ForceRelease(str(allocation_id), claims)

    async def save(self, release: ForceRelease) -> ForceReleaseSaved:
        alloc = uuid.UUID(release.allocation_id)
        moved: list[str] = []
        for ch in release.changes:
            if isinstance(ch, SlotsMoved):
                moved += [i for i in sorted(ch.slot_ids) if self.world.slots[i].status in ch.only_from]
                self.world.move(ch.slot_ids, ch.status, ch.reason, ch.only_from, alloc, ch.detail, ch.health)
            elif isinstance(ch, NodeDrained):
                self.world.drained[ch.node_id] = ch.reason
        release.changes.clear()
        ended = self.world.live(alloc) if release.released else []
        for c in ended:
            c.status = "released"
        self.world.refreshed.append(release.node_ids)
        return ForceReleaseSaved(len(ended), tuple(moved))


@dataclass
class FakeRepositories:
    nodes: FakeNodes
    slots: FakeSlots
    claims: FakeClaims
    hosts: FakeHosts | None = None
    audit: FakeAudit | None = None
    evidence: FakeEvidence | None = None
    drift: FakeDrift | None = None
    wipes: FakeWipes | None = None
    asks: FakeAsks | None = None
    # --- admin: nodes, quotas, drift, wipe, force release (issue 39) ---
    node_admin: FakeAdminNodes | None = None
    quotas: FakeQuotas | None = None
    drift_log: FakeDriftLog | None = None
    wipe_policies: FakeWipePolicies | None = None
    force_releases: FakeForceReleases | None = None


def fake_repositories(world: World) -> FakeRepositories:
    return FakeRepositories(
        FakeNodes(world),
        FakeSlots(world),
        FakeClaims(world),
        FakeHosts(world),
        FakeAudit(world),
        FakeEvidence(world),
        FakeDrift(world),
        FakeWipes(world),
        FakeAsks(world),
        FakeAdminNodes(world),
        FakeQuotas(world),
        FakeDriftLog(world),
        FakeWipePolicies(world),
        FakeForceReleases(world),
    )
