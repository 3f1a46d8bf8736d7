"""A host's slots as `scheduler.slots_changed` announces them (migrations/020_slot_announcements.sql).

One statement moves the node's announcement counter on and reads every slot of the node. The UPDATE takes the
node's row lock if the caller does not hold it already (every writer of a node's slots does: inventory's locking
protocol), so two announcements of one host are numbered in the order they commit, and the slots read are those
the caller's transaction has written."""

from __future__ import annotations

import asyncpg

from gpuaas_common.contract import messages as m

_ANNOUNCE_SQL = (
    "WITH n AS (UPDATE nodes SET slots_announced = slots_announced + 1 WHERE node_id = $1 "
    "  RETURNING slots_announced) "
    "SELECT n.slots_announced, s.slot_id, s.status, s.status_reason, s.health_state, s.health_detail, s.profile, "
    "  s.gpu_pci_address, s.nvme_by_id, s.private_ip, s.updated_at "
    "FROM n LEFT JOIN node_resource_slots s ON s.node_id = $1 ORDER BY s.slot_id"
)
# The contract's bound on a reason; the slot's own may be longer (an approval lists every problem).
_REASON_MAX = 500


def _cut(text: str | None) -> str | None:
    return None if text is None else text[:_REASON_MAX]


async def slots_changed(
    conn: asyncpg.Connection, node_id: str, cause: m.SlotsChangeCause, actor: str
) -> m.SlotsChanged | None:
    """The node's next announcement: its number and every slot of it as this transaction sees them. None for a
    node the scheduler does not have."""
    rows = await conn.fetch(_ANNOUNCE_SQL, node_id)
    if not rows:
        return None
    slots = [
        m.SlotState(
            slot_id=r["slot_id"],
            status=r["status"],
            status_reason=_cut(r["status_reason"]),
            health_state=r["health_state"],
            health_detail=_cut(r["health_detail"]),
            profile=r["profile"],
            gpu_pci_address=r["gpu_pci_address"],
            nvme_by_id=r["nvme_by_id"],
            private_ip=r["private_ip"],
            updated_at=r["updated_at"],
        )
        for r in rows
        if r["slot_id"] is not None
    ]
    return m.SlotsChanged(
        node_id=node_id, generation=rows[0]["slots_announced"], cause=cause, actor=actor[:128], slots=slots
    )
