"""The `Host` aggregate (domain/host.py) in Postgres: loaded under its node's row lock, its slots locked with it
(inventory's locking protocol: the node first), and saved from what its methods recorded."""

from __future__ import annotations

import asyncpg

from ..domain.host import (
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
from ..domain.node_claims import SlotsMoved
from . import admin_nodes, slot_wipes
from . import drift as drift_sql
from . import evidence as evidence_sql
from . import host_modes as mode_sql
from . import inventory as inv
from .admin_slots import CLAIMED
from .wipe_policy import effective_policy_sql

# A statement of its own after the lock: read at READ COMMITTED after the lock is granted, it sees every slot and
# claim committed by whoever held the node before.
_LOCK_SQL = (
    "SELECT draining, maintenance, parity_reported_at, topology_reported_at, drift_reported_at, evidence_reset_at "
    "FROM nodes WHERE node_id = $1 FOR UPDATE"
)
_SLOTS_SQL = (
    f"SELECT s.slot_id, s.status, s.nvme_by_id, {effective_policy_sql('s')} AS wipe_policy, {CLAIMED}, "
    "EXISTS (SELECT 1 FROM slot_wipes w WHERE w.slot_id = s.slot_id AND w.closed_at IS NULL) AS wipe_open, "
    "s.gpu_pci_address, s.fabric_vf_pci_address "
    "FROM node_resource_slots s WHERE s.node_id = $1 ORDER BY s.slot_id FOR UPDATE OF s"
)


class HostRepository:
    def __init__(self, conn: asyncpg.Connection) -> None:
        self.conn = conn

    async def get(self, node_id: str) -> Host | None:
        """The node locked FOR UPDATE, with its mode's facts and its slots (locked too); None: no such node."""
        node = await self.conn.fetchrow(_LOCK_SQL, node_id)
        if node is None:
            return None
        loaded = await mode_sql.load_host(self.conn, node_id)
        assert loaded is not None  # the row is locked: nobody deleted it since
        modes, now = loaded
        slots = tuple(HostSlot(**dict(r)) for r in await self.conn.fetch(_SLOTS_SQL, node_id))
        times = EvidenceTimes(
            node["parity_reported_at"],
            node["topology_reported_at"],
            node["drift_reported_at"],
            node["evidence_reset_at"],
        )
        return Host(
            modes.facts, now, draining=node["draining"], maintenance=node["maintenance"], slots=slots, evidence=times
        )

    async def save(self, host: Host) -> list[Change]:
        """Write what the aggregate recorded, in order, and forget it; what was written."""
        saved, host.changes = list(host.changes), []
        moved = False
        for ch in saved:
            if isinstance(ch, SlotsMoved):
                moved = await self._move(ch) or moved
            elif isinstance(ch, ModeChanged):
                await mode_sql.write_change(self.conn, ch.change)
            elif isinstance(ch, (ParityRecorded, TopologyRecorded, DriftRecorded)):
                await self._evidence(ch)
            else:
                await self._drain(ch)
        if moved:
            await inv.refresh_nodes(self.conn, [host.node_id])
        return saved

    async def _drain(self, ch: Drained | Undrained | WipeAsked) -> None:
        if isinstance(ch, Drained):
            await admin_nodes.drain(self.conn, ch.node_id, reason=ch.reason, actor=ch.actor, maintenance=ch.maintenance)
        elif isinstance(ch, Undrained):
            await admin_nodes.undrain(self.conn, ch.node_id)
        else:
            slots = [{"slot_id": s, "nvme_by_id": d, "wipe_policy": p} for s, d, p in ch.slots]
            await slot_wipes.open_asks(
                self.conn, ch.task_id, ch.node_id, slots, cause=ch.cause, why=ch.why, actor=ch.actor
            )

    async def _move(self, ch: SlotsMoved) -> bool:
        rows = await inv.move_slots(
            self.conn, ch.slot_ids, ch.status, ch.reason, actor=ch.actor, only_from=ch.only_from, detail=ch.detail
        )
        return bool(rows)

    async def _evidence(self, ch: ParityRecorded | TopologyRecorded | DriftRecorded) -> None:
        # The statements keep their own newer-than guards: the aggregate decided under the same row lock, so they
        # agree, and a statement run outside it can still not roll the evidence back.
        if isinstance(ch, ParityRecorded):
            await evidence_sql.update_parity(self.conn, ch.node_id, ch.failures, ch.detail, ch.checked_at)
        elif isinstance(ch, TopologyRecorded):
            await evidence_sql.update_topology(
                self.conn,
                ch.node_id,
                ch.discovered_at,
                list(ch.blockers),
                ch.hugepages_1g_total,
                ch.hugepages_1g_free,
                ch.fabric_manager,
            )
            await evidence_sql.replace_unapproved_candidates(self.conn, ch.node_id, ch.candidates)
        else:
            await drift_sql.record(self.conn, ch)
