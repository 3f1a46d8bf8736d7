"""The placement an allocation already holds, rebuilt from its claims: the scheduler's answer to a repeated
placement request (the allocator re-asks when it lost track of the first answer)."""

from __future__ import annotations

import uuid

import asyncpg

from gpuaas_common.contract import messages as m

from ...domain.nvlink_partitions import partition_for
from ..wipe_policy import effective_policy_sql
from .predicates import SLOT_COLUMNS

_SLOT_SELECT = ", ".join("s." + c.strip() for c in SLOT_COLUMNS.split(","))


async def held_placement(conn: asyncpg.Connection, allocation_id: uuid.UUID) -> m.PlacementPlaced | None:
    """The held claims as the placement first announced them (same node, slots and fencing epoch); None when the
    allocation holds nothing (never placed, or its claims are released)."""
    rows = await conn.fetch(
        f"SELECT c.node_id, c.claim_kind, c.fencing_epoch, n.maas_system_id, {_SLOT_SELECT}, "
        f"CASE WHEN s.slot_id IS NOT NULL THEN {effective_policy_sql('s')} END AS wipe_policy "
        "FROM allocation_resource_claims c JOIN nodes n ON n.node_id = c.node_id "
        "LEFT JOIN node_resource_slots s ON s.slot_id = c.slot_id "
        "WHERE c.allocation_id = $1 AND c.status = 'held' ORDER BY c.slot_id",
        allocation_id,
    )
    if not rows:
        return None
    first = rows[0]
    if first["claim_kind"] == "node_exclusive":
        return m.PlacementPlaced(
            allocation_id=allocation_id,
            node_id=first["node_id"],
            claim_mode="node_exclusive",
            fencing_epoch=first["fencing_epoch"],
            maas_system_id=first["maas_system_id"],
        )
    fields = m.SlotBinding.model_fields
    # The partition is not stored: the claimed slots' module IDs name it, as they did when it was chosen.
    modules = [r["module_id"] for r in rows]
    partition = partition_for(modules) if all(mid is not None for mid in modules) else None
    return m.PlacementPlaced(
        allocation_id=allocation_id,
        node_id=first["node_id"],
        claim_mode="slots",
        fencing_epoch=first["fencing_epoch"],
        slots=[m.SlotBinding(**{k: r[k] for k in r.keys() if k in fields}) for r in rows],
        nvlink_partition=partition.partition_id if partition else None,
    )
