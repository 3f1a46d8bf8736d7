"""The admin API's statements on slot candidates and slots: views, candidate upserts, the approval
write, and the rows retirement, disable and repair decide on.

Callers hold the node's row lock (inventory's locking protocol). Status changes after approval go
through `inventory.move_slots`; the approval write checks its own rule (domain/slots.py,
`check_approval`) in the statement that writes the slot."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import asyncpg

from ..domain.slots import APPROVAL_REPLACES, InvalidSlotTransition, check_approval
from .evidence import CANDIDATE_FIELDS as REPORTED_CANDIDATE_FIELDS

SLOT_VIEW = (
    "slot_id, node_id, gpu_pci_address, numa_node, pcie_switch, nvme_by_id, nvme_evidence, fabric_claim_mode, "
    "fabric_vf_pci_address, mac, private_ip, ovs_bridge, ovs_port, profile, status, status_reason, health_state, "
    "health_detail, generation, candidate_id, approved_by, approved_at, updated_at, storage_ownership, storage_mode, "
    "destructive_wipe_policy, storage_identity_kind, emulated, module_id"
)
# Storage metadata recorded at approval (migrations/007_slot_storage.sql says what each means).
STORAGE_FIELDS = ("storage_ownership", "storage_mode", "destructive_wipe_policy", "storage_identity_kind")
# What an agent reports for a candidate, plus the runtime profile ops choose at approval.
CANDIDATE_FIELDS = (*REPORTED_CANDIDATE_FIELDS, "profile")
# `claimed`: a live claim names the slot, whatever its status says.
CLAIMED = (
    "EXISTS (SELECT 1 FROM allocation_resource_claims c WHERE c.slot_id = s.slot_id "
    "AND c.status <> 'released') AS claimed"
)


class GpuAlreadyCandidate(Exception):
    """Another candidate of the node holds this GPU; the transaction is aborted and must roll back."""


def _json(value: Any) -> str | None:
    return json.dumps(value) if value is not None else None


# --- views ---------------------------------------------------------------------------------------------


async def list_slots(conn: asyncpg.Connection, node_id: str | None, status: str | None) -> list[asyncpg.Record]:
    return await conn.fetch(
        f"SELECT {SLOT_VIEW} FROM node_resource_slots WHERE ($1::text IS NULL OR node_id = $1) "
        "AND ($2::text IS NULL OR status = $2) ORDER BY node_id, slot_id",
        node_id,
        status,
    )


async def slot_view(conn: asyncpg.Connection, slot_id: str) -> asyncpg.Record | None:
    return await conn.fetchrow(f"SELECT {SLOT_VIEW} FROM node_resource_slots WHERE slot_id = $1", slot_id)


async def slot_history(conn: asyncpg.Connection, slot_id: str, limit: int = 50) -> list[asyncpg.Record]:
    return await conn.fetch(
        "SELECT from_status, to_status, reason, actor, allocation_id, detail, at FROM slot_transitions "
        "WHERE slot_id = $1 ORDER BY id DESC LIMIT $2",
        slot_id,
        limit,
    )


async def node_slots(conn: asyncpg.Connection, node_id: str) -> list[asyncpg.Record]:
    return await conn.fetch("SELECT * FROM node_resource_slots WHERE node_id = $1", node_id)


async def other_unretired_slots(conn: asyncpg.Connection, node_id: str, slot_id: str) -> list[asyncpg.Record]:
    """The slots of the node that still own their bindings, but this one."""
    return await conn.fetch(
        "SELECT * FROM node_resource_slots WHERE node_id = $1 AND slot_id <> $2 AND status <> 'retired'",
        node_id,
        slot_id,
    )


# --- candidates ----------------------------------------------------------------------------------------


async def list_candidates(
    conn: asyncpg.Connection, node_id: str, candidate_ids: Sequence[str] | None = None
) -> list[asyncpg.Record]:
    """The node's candidates (only those named, when candidate_ids is given), in id order."""
    return await conn.fetch(
        "SELECT * FROM candidate_slots WHERE node_id = $1 AND ($2::text[] IS NULL OR candidate_id = ANY($2::text[])) "
        "ORDER BY candidate_id",
        node_id,
        list(candidate_ids) if candidate_ids is not None else None,
    )


async def candidates_elsewhere(conn: asyncpg.Connection, candidate_ids: Sequence[str], node_id: str) -> dict[str, str]:
    """Of these candidate ids, those recorded on another node: id -> that node."""
    rows = await conn.fetch(
        "SELECT candidate_id, node_id FROM candidate_slots WHERE candidate_id = ANY($1::text[]) AND node_id <> $2",
        list(candidate_ids),
        node_id,
    )
    return {r["candidate_id"]: r["node_id"] for r in rows}


async def upsert_candidate(
    conn: asyncpg.Connection,
    node_id: str,
    candidate_id: str,
    fields: Mapping[str, Any],
    nvme_evidence: Mapping[str, Any] | None,
    source: str,
) -> None:
    """fields: every name of CANDIDATE_FIELDS. Raises GpuAlreadyCandidate."""
    n = len(CANDIDATE_FIELDS)
    try:
        await conn.execute(
            f"INSERT INTO candidate_slots (candidate_id, node_id, {', '.join(CANDIDATE_FIELDS)}, nvme_evidence, "
            f"source) VALUES ($1, $2, {', '.join(f'${i + 3}' for i in range(n))}, ${n + 3}::jsonb, ${n + 4}) "
            f"ON CONFLICT (candidate_id) DO UPDATE SET {', '.join(f'{f} = EXCLUDED.{f}' for f in CANDIDATE_FIELDS)}, "
            "nvme_evidence = EXCLUDED.nvme_evidence, source = EXCLUDED.source, updated_at = now()",
            candidate_id,
            node_id,
            *(fields[f] for f in CANDIDATE_FIELDS),
            _json(nvme_evidence),
            source,
        )
    except asyncpg.UniqueViolationError:
        raise GpuAlreadyCandidate(candidate_id) from None


# --- approval ------------------------------------------------------------------------------------------


async def save_approval(
    conn: asyncpg.Connection,
    slot_id: str,
    node_id: str,
    candidate: Mapping[str, Any],
    *,
    previous: str | None,
    status: str,
    reason: str | None,
    actor: str,
    log_reason: str | None,
    problems: list[str],
) -> None:
    """Write the slot a candidate approves to (created, or its binding replaced), log the transition and
    mark the candidate approved. `previous` is the slot's status as the caller read it under the node
    lock (None: no slot yet). Raises InvalidSlotTransition, with nothing written, when the approval rule
    refuses `previous` or the row's actual status."""
    check_approval(previous, status)
    c = candidate
    written = await conn.fetchval(
        "INSERT INTO node_resource_slots (slot_id, node_id, gpu_pci_address, numa_node, pcie_switch, nvme_by_id, "
        "nvme_evidence, fabric_claim_mode, fabric_vf_pci_address, mac, private_ip, ovs_bridge, ovs_port, profile, "
        "status, status_reason, candidate_id, approved_by, approved_at, health_state, health_detail, "
        "storage_ownership, storage_mode, destructive_wipe_policy, storage_identity_kind, emulated, module_id) "
        "VALUES ($1, $2, $3, $4, $5, $6, $7::jsonb, $8, $9, $10, $11, $12, $13, $14, $15, $16, $17, $18, now(), "
        "'healthy', NULL, $20, $21, $22, $23, $24, $25) "
        "ON CONFLICT (slot_id) DO UPDATE SET gpu_pci_address = EXCLUDED.gpu_pci_address, "
        "numa_node = EXCLUDED.numa_node, pcie_switch = EXCLUDED.pcie_switch, nvme_by_id = EXCLUDED.nvme_by_id, "
        "nvme_evidence = EXCLUDED.nvme_evidence, "
        "fabric_claim_mode = EXCLUDED.fabric_claim_mode, fabric_vf_pci_address = EXCLUDED.fabric_vf_pci_address, "
        "mac = EXCLUDED.mac, private_ip = EXCLUDED.private_ip, ovs_bridge = EXCLUDED.ovs_bridge, "
        "ovs_port = EXCLUDED.ovs_port, profile = EXCLUDED.profile, status = EXCLUDED.status, "
        "status_reason = EXCLUDED.status_reason, candidate_id = EXCLUDED.candidate_id, "
        "approved_by = EXCLUDED.approved_by, approved_at = now(), generation = node_resource_slots.generation + 1, "
        "storage_ownership = EXCLUDED.storage_ownership, storage_mode = EXCLUDED.storage_mode, "
        "destructive_wipe_policy = EXCLUDED.destructive_wipe_policy, "
        "storage_identity_kind = EXCLUDED.storage_identity_kind, emulated = EXCLUDED.emulated, "
        "module_id = EXCLUDED.module_id, "
        "updated_at = now() "
        # The replace rule again, on the row as it is: nothing approval may not replace is overwritten.
        "WHERE node_resource_slots.status = ANY($19::text[]) RETURNING slot_id",
        slot_id,
        node_id,
        c["gpu_pci_address"],
        c["numa_node"],
        c["pcie_switch"],
        c["nvme_by_id"],
        _json(c["nvme_evidence"]),
        c["fabric_claim_mode"],
        c["fabric_vf_pci_address"],
        c["mac"],
        c["private_ip"],
        c["ovs_bridge"] or "ovsbr0",
        c["ovs_port"],
        c["profile"],
        status,
        reason,
        c["candidate_id"],
        actor,
        sorted(APPROVAL_REPLACES),
        c.get("storage_ownership", "slice"),
        c.get("storage_mode", "slice"),
        c.get("destructive_wipe_policy", "blkdiscard"),
        c.get("storage_identity_kind", "nvme_wwn_by_id"),
        bool(c.get("emulated")),
        c.get("module_id"),
    )
    if written is None:
        current = await conn.fetchval("SELECT status FROM node_resource_slots WHERE slot_id = $1", slot_id)
        raise InvalidSlotTransition(f"approval cannot replace slot {slot_id}: it is {current}, not {previous}")
    await conn.execute(
        "INSERT INTO slot_transitions (slot_id, from_status, to_status, reason, actor, detail) "
        "VALUES ($1, $2, $3, $4, $5, $6::jsonb)",
        slot_id,
        previous,
        status,
        log_reason,
        actor,
        json.dumps({"candidate_id": c["candidate_id"], "problems": problems}),
    )
    await conn.execute(
        "UPDATE candidate_slots SET approved_slot_id = $2 WHERE candidate_id = $1", c["candidate_id"], slot_id
    )


# --- retire, disable, repair ---------------------------------------------------------------------------


async def lock_node_slots(
    conn: asyncpg.Connection, node_id: str, slot_ids: Sequence[str] | None
) -> list[asyncpg.Record]:
    """slot_id, status, claimed of the node's slots (only those named, when slot_ids is given), locked."""
    return await conn.fetch(
        f"SELECT s.slot_id, s.status, {CLAIMED} FROM node_resource_slots s WHERE s.node_id = $1 "
        "AND ($2::text[] IS NULL OR s.slot_id = ANY($2::text[])) ORDER BY s.slot_id FOR UPDATE OF s",
        node_id,
        list(slot_ids) if slot_ids is not None else None,
    )


async def slot_node(conn: asyncpg.Connection, slot_id: str) -> str | None:
    return await conn.fetchval("SELECT node_id FROM node_resource_slots WHERE slot_id = $1", slot_id)


async def lock_slot(conn: asyncpg.Connection, slot_id: str) -> asyncpg.Record | None:
    """The whole slot row and `claimed`, locked (after its node: see the module's docstring)."""
    return await conn.fetchrow(
        f"SELECT s.*, {CLAIMED} FROM node_resource_slots s WHERE s.slot_id = $1 FOR UPDATE OF s",
        slot_id,
    )


async def set_nvme_evidence(conn: asyncpg.Connection, slot_id: str, evidence: Mapping[str, Any]) -> None:
    await conn.execute(
        "UPDATE node_resource_slots SET nvme_evidence = $2::jsonb WHERE slot_id = $1", slot_id, json.dumps(evidence)
    )
