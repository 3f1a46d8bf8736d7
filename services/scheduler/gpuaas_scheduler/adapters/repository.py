"""The scheduler's repositories on `uow.repos` (see gpuaas_common.unit_of_work): nodes, slots, claims and host
modes, each on the unit of work's connection, so handlers go through them and never hold a connection.

- `claims`: an allocation's lock, its live claims loaded as a `NodeClaims` aggregate (domain/node_claims.py)
  and saved from what its methods recorded, and the placement it already holds;
- `slots`: the lifecycle moves of an allocation's slots, one guarded statement each, and a host's slots as they
  are announced (scheduler.slots_changed);
- `nodes`: node locks, drains and the capacity summary;
- `hosts`: the `Host` aggregate of domain/host.py (adapters/hosts.py);
- `audit`: the admin trail;
- `evidence`, `drift`, `wipes`, `asks`, `modes`, `vfio`, `walks`: what the host's reports and the sweeps read and write
  beside the `Host` (adapters/evidence.py, drift.py, slot_wipes.py, node_actions.py, host_modes.py,
  vfio_binding.py, host_walk.py).
- `node_admin`, `quotas`, `drift_log`, `wipe_policies`, `force_releases`: the inventory admin's (adapters/admin.py).

Placement's search (service_layer/placement.py) runs its own statements and savepoints on `conn`: it is one
search inside one transaction, not an aggregate to load and save.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import asyncpg

from gpuaas_common.contract import messages as m

from ..domain.node_claims import HeldClaim, NodeClaims, NodeDrained, SlotsMoved
from . import admin_nodes, slot_announcements
from . import inventory as inv
from .admin import (
    AdminNodeRepository,
    DriftLogRepository,
    ForceReleaseRepository,
    QuotaRepository,
    WipePolicyRepository,
)
from .drift import DriftRepository
from .evidence import EvidenceRepository
from .host_modes import HostModeRepository
from .host_walk import WalkRepository
from .hosts import HostRepository
from .inventory.held import held_placement
from .node_actions import NodeActionRepository
from .slot_wipes import SlotWipeRepository
from .vfio_binding import VfioSlotRepository
from .wipe_policy import effective_policy_sql, policy_site_sql

_LOAD_SQL = (
    "SELECT c.node_id, c.slot_id, c.claim_kind, s.status, s.nvme_by_id, "
    f"{effective_policy_sql('s')} AS destructive_wipe_policy, {policy_site_sql('s')} AS wipe_policy_site, "
    "CASE WHEN $2::text IS NULL OR c.slot_id IS NULL THEN false ELSE EXISTS (SELECT 1 FROM slot_transitions t "
    "  WHERE t.slot_id = c.slot_id AND t.allocation_id = $1 AND t.to_status = $2::text) END AS reached "
    "FROM allocation_resource_claims c LEFT JOIN node_resource_slots s ON s.slot_id = c.slot_id "
    "WHERE c.allocation_id = $1 AND c.status <> 'released' ORDER BY c.slot_id"
)


class ClaimRepository:
    def __init__(self, conn: asyncpg.Connection) -> None:
        self.conn = conn

    async def lock_allocation(self, allocation_id: uuid.UUID) -> None:
        await inv.lock_allocation(self.conn, allocation_id)

    async def load(self, allocation_id: uuid.UUID, *, log_reached: str | None = None) -> NodeClaims:
        """The allocation's live claims with their slots, under the locks of their nodes (taken after the read,
        in id order, as every node locker does). `log_reached`: the status to look up in each slot's transition
        log under this allocation (`NodeClaims.log_to_check`)."""
        rows = await self.conn.fetch(_LOAD_SQL, allocation_id, log_reached)
        claims = NodeClaims(str(allocation_id), tuple(HeldClaim(**dict(r)) for r in rows))
        await inv.lock_nodes(self.conn, claims.node_ids)
        return claims

    async def save(self, claims: NodeClaims) -> int:
        """Write what the aggregate's methods recorded, in order; end its claims if it was released. The number of
        claims ended."""
        allocation_id = uuid.UUID(claims.allocation_id)
        for change in claims.changes:
            if isinstance(change, SlotsMoved):
                await inv.move_slots(
                    self.conn,
                    change.slot_ids,
                    change.status,
                    change.reason,
                    actor=change.actor,
                    only_from=change.only_from,
                    allocation_id=allocation_id,
                    detail=change.detail,
                    health=change.health,
                )
            elif isinstance(change, NodeDrained):
                await inv.drain_node(self.conn, change.node_id, change.reason, actor=change.actor)
        claims.changes.clear()
        if not claims.released:
            return 0
        return len(await inv.release_claims(self.conn, allocation_id))

    async def held_placement(self, allocation_id: uuid.UUID) -> m.PlacementPlaced | None:
        return await held_placement(self.conn, allocation_id)


class SlotRepository:
    def __init__(self, conn: asyncpg.Connection) -> None:
        self.conn = conn

    async def move_for_allocation(self, allocation_id: uuid.UUID, status: str, only_from: tuple[str, ...]) -> int:
        """Move the slots of the allocation's live claims that are in `only_from` (a subset of the moves
        domain/slots.py allows), and log each move: one statement. How many moved."""
        return await inv.set_slot_status(self.conn, allocation_id, status, only_from=only_from)

    async def statuses(self, allocation_id: uuid.UUID) -> dict[str, str]:
        """The status of each slot the allocation's live claims hold."""
        return {r["slot_id"]: r["status"] for r in await inv.allocation_slots(self.conn, allocation_id) if r["slot_id"]}

    async def announcement(self, node_id: str, cause: m.SlotsChangeCause, actor: str) -> m.SlotsChanged | None:
        """The node's slots as `scheduler.slots_changed` announces them, under the node's next number (None: no
        such node)."""
        return await slot_announcements.slots_changed(self.conn, node_id, cause, actor)


class NodeRepository:
    def __init__(self, conn: asyncpg.Connection) -> None:
        self.conn = conn

    async def refresh(self, node_ids: Iterable[str]) -> None:
        """Recompute the nodes' capacity summary, in the unit of work's transaction."""
        await inv.refresh_nodes(self.conn, list(node_ids))


class AuditRepository:
    """The admin trail (admin_audit): who did what to which target, why, with what detail."""

    def __init__(self, conn: asyncpg.Connection) -> None:
        self.conn = conn

    async def record(
        self, actor: str, action: str, target: str, reason: str | None, detail: dict[str, Any] | None = None
    ) -> None:
        await admin_nodes.audit(self.conn, actor, action, target, reason, detail)


@dataclass
class SchedulerRepositories:
    conn: asyncpg.Connection
    nodes: NodeRepository
    slots: SlotRepository
    claims: ClaimRepository
    hosts: HostRepository
    audit: AuditRepository
    # --- evidence, steering, drift, wipes, walks (issue 39) ---
    evidence: EvidenceRepository
    drift: DriftRepository
    wipes: SlotWipeRepository
    asks: NodeActionRepository
    modes: HostModeRepository
    vfio: VfioSlotRepository
    walks: WalkRepository
    # --- admin: nodes, quotas, drift, wipe, force release (issue 39) ---
    node_admin: AdminNodeRepository
    quotas: QuotaRepository
    drift_log: DriftLogRepository
    wipe_policies: WipePolicyRepository
    force_releases: ForceReleaseRepository


def scheduler_repositories(conn: asyncpg.Connection) -> SchedulerRepositories:
    """The factory a UnitOfWork (the bus's, the benchmark's, the tests') builds `uow.repos` with."""
    return SchedulerRepositories(
        conn,
        NodeRepository(conn),
        SlotRepository(conn),
        ClaimRepository(conn),
        HostRepository(conn),
        AuditRepository(conn),
        EvidenceRepository(conn),
        DriftRepository(conn),
        SlotWipeRepository(conn),
        NodeActionRepository(conn),
        HostModeRepository(conn),
        VfioSlotRepository(conn),
        WalkRepository(conn),
        AdminNodeRepository(conn),
        QuotaRepository(conn),
        DriftLogRepository(conn),
        WipePolicyRepository(conn),
        ForceReleaseRepository(conn),
    )


def repositories_of(uow: Any) -> SchedulerRepositories:
    """`uow.repos`, or for a unit of work built without repositories (a caller passing `no_repositories`, as some
    tests' buses do) the same repositories on its connection."""
    repos: SchedulerRepositories | None = uow.repos
    return repos if repos is not None else scheduler_repositories(uow.conn)
