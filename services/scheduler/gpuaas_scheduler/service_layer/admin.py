"""Admin operations on the inventory: each runs inside the caller's transaction, takes the node lock
before touching slots, writes an audit row, and raises AdminError (rolling everything back) rather
than leaving half of a change behind."""

from __future__ import annotations

import json
import re
from typing import Any, Literal

import asyncpg
from pydantic import BaseModel, ConfigDict, Field

from gpuaas_common.api_error import ApiError

from ..adapters import host_modes as mode_repo
from ..adapters import inventory as inv
from ..domain.approval import approval_problems, approved_status
from ..domain.host_mode import BAREMETAL, RETIRED, TRANSITIONS, ModeRefused
from . import host_modes

Name = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._:@-]*$")
Reason = Field(min_length=1, max_length=500)


class AdminError(ApiError):
    """An inventory operation's refusal (see gpuaas_common.api_error)."""


class Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Acted(Body):
    actor: str = Name
    reason: str = Reason


class NodeIn(Body):
    actor: str = Name
    node_id: str = Name
    kind: Literal["slice_host", "baremetal"]
    hostname: str = Field(min_length=1, max_length=253)
    region: str = Field(default="default", min_length=1, max_length=64)
    pool: str = Field(default="default", min_length=1, max_length=64)
    sku: str = Field(min_length=1, max_length=64)
    maas_system_id: str | None = None
    maas_tags: list[str] = Field(default_factory=list, max_length=64)
    mode: Literal["slice", "baremetal"] | None = None
    gpu_count: int = Field(default=8, ge=1, le=64)


class ModeIn(Acted):
    mode: Literal["slice", "baremetal", "converting", "drained", "retired"]


class RetireIn(Acted):
    slot_ids: list[str] | None = Field(default=None, max_length=64)


class ReadinessIn(Body):
    actor: str = Name
    # Bounded like every integer here: the columns are int4 and a larger number is a client error, not a 500.
    parity_failures: int = Field(ge=0, le=1_000_000)
    detail: dict[str, Any] | None = None


class DrainIn(Acted):
    maintenance: bool = False


class NvmeEvidence(Body):
    mounted: bool
    mounted_children: list[str] = Field(default_factory=list)
    signatures: list[str] | None
    is_os_disk: bool


class CandidateIn(Body):
    candidate_id: str = Name
    gpu_pci_address: str | None = Field(default=None, pattern=r"^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")
    numa_node: int | None = Field(default=None, ge=0, le=1024)
    pcie_switch: str | None = Field(default=None, max_length=128)
    nvme_by_id: str | None = Field(default=None, max_length=1024)
    nvme_evidence: NvmeEvidence | None = None
    fabric_claim_mode: Literal["per_slot_vf", "shared"] | None = None
    fabric_vf_pci_address: str | None = Field(default=None, max_length=32)
    mac: str | None = Field(default=None, pattern=r"^[0-9a-f]{2}(:[0-9a-f]{2}){5}$")
    private_ip: str | None = Field(default=None, max_length=45)
    ovs_bridge: str | None = Field(default=None, max_length=64)
    ovs_port: str | None = Field(default=None, max_length=64)
    profile: str = Field(default="h200_1g_24c_64g", pattern=r"^[a-z0-9_]+$", max_length=64)


class CandidatesIn(Body):
    actor: str = Name
    source: Literal["admin", "discovery"] = "admin"
    candidates: list[CandidateIn] = Field(min_length=1, max_length=64)


class ApproveIn(Body):
    actor: str = Name
    reason: str | None = Field(default=None, max_length=500)
    candidate_ids: list[str] | None = Field(default=None, max_length=64)


class RepairIn(Acted):
    nvme_evidence: NvmeEvidence | None = None


class QuotaIn(Acted):
    max_gpus: int = Field(ge=0, le=1_000_000)


CANDIDATE_FIELDS = ("gpu_pci_address", "numa_node", "pcie_switch", "nvme_by_id", "fabric_claim_mode",
                    "fabric_vf_pci_address", "mac", "private_ip", "ovs_bridge", "ovs_port", "profile")
LIVE_SLOT_STATES = ("reserved", "provisioning", "active", "releasing", "cleanup")


def _jsonable(row: asyncpg.Record | dict) -> dict:
    out = {}
    for k, v in dict(row).items():
        if hasattr(v, "isoformat"):
            v = v.isoformat()
        elif k in ("nvme_evidence", "parity_detail", "detail") and isinstance(v, str):
            v = json.loads(v)
        elif k == "allocation_id" and v is not None:
            v = str(v)
        out[k] = v
    return out


async def audit(conn: asyncpg.Connection, actor: str, action: str, target: str, reason: str | None,
                detail: dict | None = None) -> None:
    await conn.execute(
        "INSERT INTO admin_audit (actor, action, target, reason, detail) VALUES ($1, $2, $3, $4, $5::jsonb)",
        actor, action, target, reason, json.dumps(detail) if detail is not None else None,
    )


async def _lock_node(conn: asyncpg.Connection, node_id: str) -> asyncpg.Record:
    row = await conn.fetchrow("SELECT * FROM nodes WHERE node_id = $1 FOR UPDATE", node_id)
    if row is None:
        raise AdminError(404, "node_not_found", f"no node {node_id!r}")
    return row


NODE_VIEW = (
    "node_id, kind, hostname, region, pool, sku, maas_system_id, maas_tags, accepts_slices, accepts_baremetal, mode, "
    "mode_changed_at, mode_changed_by, mode_reason, evidence_reset_at, topology_reported_at, "
    "schedulable, parity_failures, parity_checked_at, parity_detail, draining, drain_reason, drained_by, drained_at, "
    "maintenance, maintenance_reason, gpu_count, free_slots, total_slots, sliced, numa_free, updated_at"
)
SLOT_VIEW = (
    "slot_id, node_id, gpu_pci_address, numa_node, pcie_switch, nvme_by_id, nvme_evidence, fabric_claim_mode, "
    "fabric_vf_pci_address, mac, private_ip, ovs_bridge, ovs_port, profile, status, status_reason, health_state, "
    "health_detail, generation, candidate_id, approved_by, approved_at, updated_at"
)


async def list_nodes(conn: asyncpg.Connection, region: str | None = None, sku: str | None = None) -> dict:
    rows = await conn.fetch(
        f"SELECT {NODE_VIEW} FROM nodes WHERE ($1::text IS NULL OR region = $1) AND ($2::text IS NULL OR sku = $2) "
        "ORDER BY node_id",
        region, sku,
    )
    return {"nodes": [_jsonable(r) for r in rows]}


async def get_node(conn: asyncpg.Connection, node_id: str) -> dict:
    row = await conn.fetchrow(f"SELECT {NODE_VIEW} FROM nodes WHERE node_id = $1", node_id)
    if row is None:
        raise AdminError(404, "node_not_found", f"no node {node_id!r}")
    claims = await conn.fetch(
        "SELECT allocation_id, slot_id, claim_kind, status, tenant_id, gpus, fencing_epoch, created_at "
        "FROM allocation_resource_claims WHERE node_id = $1 AND status <> 'released' ORDER BY claim_id", node_id,
    )
    history = await mode_repo.history(conn, node_id)
    return {"node": _jsonable(row), "live_claims": [_jsonable(c) for c in claims],
            "mode_history": [_jsonable(h) for h in history]}


async def upsert_node(conn: asyncpg.Connection, body: NodeIn) -> dict:
    intent = "slice-vm" if inv.TAG_SLICE in body.maas_tags else "baremetal"
    current = await conn.fetchval("SELECT mode FROM nodes WHERE node_id = $1 FOR UPDATE", body.node_id)
    if current is not None and body.mode is not None and body.mode != current:
        # Registration sets the first mode only; later changes have guards and a history.
        raise AdminError(409, "mode_transition_refused",
                         f"node {body.node_id} is {current}: change its mode with POST /v1/nodes/{{node_id}}/mode",
                         {"from": current, "to": body.mode})
    mode = body.mode or ("slice" if body.kind == "slice_host" else "baremetal")
    await conn.execute(
        "INSERT INTO nodes (node_id, kind, hostname, region, pool, sku, maas_system_id, profile_intent, maas_tags, "
        "mode, gpu_count) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11) "
        "ON CONFLICT (node_id) DO UPDATE SET hostname = EXCLUDED.hostname, region = EXCLUDED.region, "
        "pool = EXCLUDED.pool, sku = EXCLUDED.sku, maas_system_id = EXCLUDED.maas_system_id, "
        "profile_intent = EXCLUDED.profile_intent, maas_tags = EXCLUDED.maas_tags, "
        "gpu_count = EXCLUDED.gpu_count, updated_at = now()",
        body.node_id, body.kind, body.hostname, body.region, body.pool, body.sku, body.maas_system_id, intent,
        body.maas_tags, mode, body.gpu_count,
    )
    if current is None:
        await mode_repo.record_created(conn, [body.node_id], body.actor, "registered through the admin API")
    await audit(conn, body.actor, "node.upsert", body.node_id, None, body.model_dump(exclude={"actor"}))
    await inv.refresh_nodes(conn, [body.node_id])
    return await get_node(conn, body.node_id)


async def set_readiness(conn: asyncpg.Connection, node_id: str, body: ReadinessIn) -> dict:
    await _lock_node(conn, node_id)
    await conn.execute(
        "UPDATE nodes SET parity_failures = $2, parity_detail = $3::jsonb, parity_checked_at = now(), updated_at = now() "
        "WHERE node_id = $1",
        node_id, body.parity_failures, json.dumps(body.detail) if body.detail is not None else None,
    )
    await audit(conn, body.actor, "node.readiness", node_id, None, {"parity_failures": body.parity_failures})
    return await get_node(conn, node_id)


async def drain(conn: asyncpg.Connection, node_id: str, body: DrainIn) -> dict:
    await _lock_node(conn, node_id)
    await conn.execute(
        "UPDATE nodes SET draining = true, drain_reason = $2, drained_by = $3, drained_at = now(), "
        "maintenance = maintenance OR $4, maintenance_reason = CASE WHEN $4 THEN $2 ELSE maintenance_reason END, "
        "updated_at = now() WHERE node_id = $1",
        node_id, body.reason, body.actor, body.maintenance,
    )
    await audit(conn, body.actor, "node.drain", node_id, body.reason, {"maintenance": body.maintenance})
    return await get_node(conn, node_id)


async def undrain(conn: asyncpg.Connection, node_id: str, body: Acted) -> dict:
    await _lock_node(conn, node_id)
    await conn.execute(
        "UPDATE nodes SET draining = false, drain_reason = NULL, drained_by = NULL, drained_at = NULL, "
        "maintenance = false, maintenance_reason = NULL, updated_at = now() WHERE node_id = $1",
        node_id,
    )
    await audit(conn, body.actor, "node.undrain", node_id, body.reason)
    return await get_node(conn, node_id)


async def get_mode(conn: asyncpg.Connection, node_id: str) -> dict:
    """The node's mode with who/why/when, what each transition out of it still needs, and its history."""
    loaded = await mode_repo.load_host(conn, node_id)
    if loaded is None:
        raise AdminError(404, "node_not_found", f"no node {node_id!r}")
    host, _ = loaded
    row = await conn.fetchrow(
        "SELECT mode_changed_at, mode_changed_by, mode_reason, evidence_reset_at FROM nodes WHERE node_id = $1",
        node_id)
    transitions = {to: host.blockers(to) for (frm, to) in TRANSITIONS if frm == host.mode}
    history = await mode_repo.history(conn, node_id)
    return {"node_id": node_id, "mode": host.mode, **_jsonable(row), "transitions": transitions,
            "history": [_jsonable(h) for h in history]}


async def set_mode(conn: asyncpg.Connection, node_id: str, body: ModeIn) -> dict:
    await _lock_node(conn, node_id)
    try:
        change = await host_modes.change_mode(conn, node_id, body.mode, actor=body.actor, reason=body.reason)
    except ModeRefused as exc:
        raise AdminError(409, "mode_transition_refused", str(exc), {
            "from": exc.current, "to": exc.target, "problems": exc.problems,
            "allowed": [to for (frm, to) in TRANSITIONS if frm == exc.current],
        }) from None
    await audit(conn, body.actor, "node.mode", node_id, body.reason,
                {"from": change.from_mode, "to": change.to_mode, "evidence_reset": change.resets_evidence})
    return await get_mode(conn, node_id)


async def list_slots(conn: asyncpg.Connection, node_id: str | None = None, status: str | None = None) -> dict:
    rows = await conn.fetch(
        f"SELECT {SLOT_VIEW} FROM node_resource_slots WHERE ($1::text IS NULL OR node_id = $1) "
        "AND ($2::text IS NULL OR status = $2) ORDER BY node_id, slot_id",
        node_id, status,
    )
    return {"slots": [_jsonable(r) for r in rows]}


async def get_slot(conn: asyncpg.Connection, slot_id: str) -> dict:
    row = await conn.fetchrow(f"SELECT {SLOT_VIEW} FROM node_resource_slots WHERE slot_id = $1", slot_id)
    if row is None:
        raise AdminError(404, "slot_not_found", f"no slot {slot_id!r}")
    history = await conn.fetch(
        "SELECT from_status, to_status, reason, actor, allocation_id, detail, at FROM slot_transitions "
        "WHERE slot_id = $1 ORDER BY id DESC LIMIT 50", slot_id,
    )
    return {"slot": _jsonable(row), "transitions": [_jsonable(h) for h in history]}


async def list_candidates(conn: asyncpg.Connection, node_id: str) -> dict:
    if not await conn.fetchval("SELECT 1 FROM nodes WHERE node_id = $1", node_id):
        raise AdminError(404, "node_not_found", f"no node {node_id!r}")
    rows = await conn.fetch("SELECT * FROM candidate_slots WHERE node_id = $1 ORDER BY candidate_id", node_id)
    return {"candidates": [_jsonable(r) for r in rows]}


async def upsert_candidates(conn: asyncpg.Connection, node_id: str, body: CandidatesIn) -> dict:
    await _lock_node(conn, node_id)
    ids = [c.candidate_id for c in body.candidates]
    if len(set(ids)) != len(ids):
        raise AdminError(422, "duplicate_candidate", "candidate ids repeat within the request")
    others = await conn.fetch(
        "SELECT candidate_id, node_id FROM candidate_slots WHERE candidate_id = ANY($1::text[]) AND node_id <> $2",
        ids, node_id,
    )
    if others:
        raise AdminError(409, "candidate_on_other_node", "candidate ids belong to another node",
                         {"candidates": {r["candidate_id"]: r["node_id"] for r in others}})
    for c in body.candidates:
        values = [getattr(c, f) for f in CANDIDATE_FIELDS]
        evidence = json.dumps(c.nvme_evidence.model_dump()) if c.nvme_evidence else None
        try:
            await conn.execute(
                f"INSERT INTO candidate_slots (candidate_id, node_id, {', '.join(CANDIDATE_FIELDS)}, nvme_evidence, "
                f"source) VALUES ($1, $2, {', '.join(f'${i + 3}' for i in range(len(CANDIDATE_FIELDS)))}, "
                f"${len(CANDIDATE_FIELDS) + 3}::jsonb, ${len(CANDIDATE_FIELDS) + 4}) ON CONFLICT (candidate_id) DO UPDATE "
                f"SET {', '.join(f'{f} = EXCLUDED.{f}' for f in CANDIDATE_FIELDS)}, nvme_evidence = EXCLUDED.nvme_evidence, "
                "source = EXCLUDED.source, updated_at = now()",
                c.candidate_id, node_id, *values, evidence, body.source,
            )
        except asyncpg.UniqueViolationError:
            raise AdminError(409, "gpu_already_a_candidate",
                             f"GPU {c.gpu_pci_address} of {node_id} is already another candidate",
                             {"candidate_id": c.candidate_id}) from None
    await audit(conn, body.actor, "candidates.upsert", node_id, None, {"candidate_ids": ids})
    return await list_candidates(conn, node_id)


def _require_all(asked: list[str] | None, found: list[asyncpg.Record], key: str, code: str, message: str) -> None:
    """A request naming ids refuses as a whole when any of them is not there (404 lists them all)."""
    if asked is None:
        return
    missing = sorted(set(asked) - {r[key] for r in found})
    if missing:
        raise AdminError(404, code, message, {f"{key}s": missing})


async def approve(conn: asyncpg.Connection, node_id: str, body: ApproveIn) -> dict:
    """Turn candidates into slots: `available` when every rule holds, else `disabled` with the reasons.
    On a converting host this is the re-approval that, with rediscovery and a passing parity run,
    returns it to slice mode."""
    node = await _lock_node(conn, node_id)
    if node["mode"] in (BAREMETAL, RETIRED):
        raise AdminError(409, "mode_forbids_approval",
                         f"node {node_id} is {node['mode']}: a slot there would promise a baremetal or retired host's "
                         "GPU and disk to slices; move it to converting and rediscover it first",
                         {"mode": node["mode"]})
    cands = await conn.fetch(
        "SELECT * FROM candidate_slots WHERE node_id = $1 AND ($2::text[] IS NULL OR candidate_id = ANY($2::text[])) "
        "ORDER BY candidate_id",
        node_id, body.candidate_ids,
    )
    _require_all(body.candidate_ids, cands, "candidate_id", "candidate_not_found", "unknown candidates")
    if not cands:
        raise AdminError(404, "candidate_not_found", f"node {node_id} has no candidates to approve")
    slots = {r["slot_id"]: dict(r) for r in await conn.fetch(
        "SELECT * FROM node_resource_slots WHERE node_id = $1", node_id)}
    results = []
    for cand in cands:
        c = dict(cand)
        c["nvme_evidence"] = json.loads(c["nvme_evidence"]) if c["nvme_evidence"] else None
        existing = next((s for s in slots.values() if s["gpu_pci_address"] and
                         s["gpu_pci_address"] == c["gpu_pci_address"]), None) or slots.get(c["candidate_id"])
        slot_id = existing["slot_id"] if existing else c["candidate_id"]
        if existing and existing["status"] in LIVE_SLOT_STATES + ("cleanup_blocked",):
            raise AdminError(409, "slot_in_use", f"slot {slot_id} is {existing['status']}; approval cannot replace it"
                             + (" (repair it instead)" if existing["status"] == "cleanup_blocked" else ""),
                             {"slot_id": slot_id, "status": existing["status"]})
        c["slot_id"] = slot_id
        # A retired slot owns no binding any more; a re-approved one takes it back.
        problems = approval_problems(c, [s for s in slots.values() if s["status"] != RETIRED])
        status, reason = approved_status(problems)
        await conn.execute(
            "INSERT INTO node_resource_slots (slot_id, node_id, gpu_pci_address, numa_node, pcie_switch, nvme_by_id, "
            "nvme_evidence, fabric_claim_mode, fabric_vf_pci_address, mac, private_ip, ovs_bridge, ovs_port, profile, "
            "status, status_reason, candidate_id, approved_by, approved_at, health_state, health_detail) "
            "VALUES ($1, $2, $3, $4, $5, $6, $7::jsonb, $8, $9, $10, $11, $12, $13, $14, $15, $16, $17, $18, now(), "
            "'healthy', NULL) "
            "ON CONFLICT (slot_id) DO UPDATE SET gpu_pci_address = EXCLUDED.gpu_pci_address, numa_node = EXCLUDED.numa_node, "
            "pcie_switch = EXCLUDED.pcie_switch, nvme_by_id = EXCLUDED.nvme_by_id, nvme_evidence = EXCLUDED.nvme_evidence, "
            "fabric_claim_mode = EXCLUDED.fabric_claim_mode, fabric_vf_pci_address = EXCLUDED.fabric_vf_pci_address, "
            "mac = EXCLUDED.mac, private_ip = EXCLUDED.private_ip, ovs_bridge = EXCLUDED.ovs_bridge, "
            "ovs_port = EXCLUDED.ovs_port, profile = EXCLUDED.profile, status = EXCLUDED.status, "
            "status_reason = EXCLUDED.status_reason, candidate_id = EXCLUDED.candidate_id, "
            "approved_by = EXCLUDED.approved_by, approved_at = now(), generation = node_resource_slots.generation + 1, "
            "updated_at = now()",
            slot_id, node_id, c["gpu_pci_address"], c["numa_node"], c["pcie_switch"], c["nvme_by_id"],
            json.dumps(c["nvme_evidence"]) if c["nvme_evidence"] is not None else None, c["fabric_claim_mode"],
            c["fabric_vf_pci_address"], c["mac"], c["private_ip"], c["ovs_bridge"] or "ovsbr0", c["ovs_port"],
            c["profile"], status, reason, c["candidate_id"], body.actor,
        )
        await conn.execute(
            "INSERT INTO slot_transitions (slot_id, from_status, to_status, reason, actor, detail) "
            "VALUES ($1, $2, $3, $4, $5, $6::jsonb)",
            slot_id, existing["status"] if existing else None, status, reason or body.reason, body.actor,
            json.dumps({"candidate_id": c["candidate_id"], "problems": problems}),
        )
        await conn.execute("UPDATE candidate_slots SET approved_slot_id = $2 WHERE candidate_id = $1",
                           c["candidate_id"], slot_id)
        slots[slot_id] = {**c, "status": status}
        results.append({"candidate_id": c["candidate_id"], "slot_id": slot_id, "status": status, "problems": problems})
    await audit(conn, body.actor, "candidates.approve", node_id, body.reason, {"results": results})
    await inv.refresh_nodes(conn, [node_id])
    mode, blockers = await host_modes.promote_if_ready(
        conn, node_id, actor=body.actor,
        reason=body.reason or "slots re-approved after rediscovery and a passing parity run")
    out: dict[str, Any] = {"results": results, "mode": mode}
    if blockers:
        out["mode_blockers"] = blockers
    return out


async def retire_slots(conn: asyncpg.Connection, node_id: str, body: RetireIn) -> dict:
    """Slots that no longer promise their GPU and disk to slices (all of the node's unretired slots when
    slot_ids is absent), atomically. A host must have retired every slot before it may serve baremetal;
    only re-approval after rediscovery brings a retired slot back."""
    await _lock_node(conn, node_id)
    rows = await conn.fetch(
        "SELECT s.slot_id, s.status, EXISTS (SELECT 1 FROM allocation_resource_claims c WHERE c.slot_id = s.slot_id "
        "AND c.status <> 'released') AS claimed FROM node_resource_slots s WHERE s.node_id = $1 "
        "AND ($2::text[] IS NULL OR s.slot_id = ANY($2::text[])) ORDER BY s.slot_id FOR UPDATE OF s",
        node_id, body.slot_ids,
    )
    _require_all(body.slot_ids, rows, "slot_id", "slot_not_found", f"slots not on node {node_id}")
    busy = {r["slot_id"]: r["status"] for r in rows
            if r["claimed"] or r["status"] in LIVE_SLOT_STATES + ("cleanup_blocked",)}
    if busy:
        # A cleanup_blocked disk may still hold a tenant's data: retiring it would hand that data to
        # whoever gets the host next. It needs a verified wipe (repair) first.
        raise AdminError(409, "slot_in_use", "slots in use or awaiting a verified wipe cannot be retired",
                         {"slots": busy})
    ids = [r["slot_id"] for r in rows if r["status"] != RETIRED]
    await inv.move_slots(conn, ids, RETIRED, body.reason, actor=body.actor)
    await audit(conn, body.actor, "slots.retire", node_id, body.reason, {"slot_ids": ids})
    await inv.refresh_nodes(conn, [node_id])
    return await list_slots(conn, node_id=node_id)


async def _lock_slot(conn: asyncpg.Connection, slot_id: str) -> dict:
    node_id = await conn.fetchval("SELECT node_id FROM node_resource_slots WHERE slot_id = $1", slot_id)
    if node_id is None:
        raise AdminError(404, "slot_not_found", f"no slot {slot_id!r}")
    await _lock_node(conn, node_id)
    row = await conn.fetchrow(
        "SELECT s.*, EXISTS (SELECT 1 FROM allocation_resource_claims c WHERE c.slot_id = s.slot_id "
        "AND c.status <> 'released') AS claimed FROM node_resource_slots s WHERE s.slot_id = $1 FOR UPDATE OF s",
        slot_id,
    )
    return dict(row)


async def disable(conn: asyncpg.Connection, slot_id: str, body: Acted) -> dict:
    slot = await _lock_slot(conn, slot_id)
    if slot["status"] == RETIRED:
        raise AdminError(409, "slot_retired", f"slot {slot_id} is retired; only re-approval brings it back")
    if slot["claimed"] or slot["status"] in LIVE_SLOT_STATES:
        raise AdminError(409, "slot_in_use", f"slot {slot_id} is {slot['status']} under a live claim",
                         {"status": slot["status"]})
    await inv.move_slots(conn, [slot_id], "disabled", body.reason, actor=body.actor)
    await audit(conn, body.actor, "slot.disable", slot_id, body.reason)
    await inv.refresh_nodes(conn, [slot["node_id"]])
    return await get_slot(conn, slot_id)


async def repair(conn: asyncpg.Connection, slot_id: str, body: RepairIn) -> dict:
    """cleanup_blocked or disabled -> available, only if the approval rules hold now (new disk
    evidence from an infra wipe can come with the request); records who and why."""
    slot = await _lock_slot(conn, slot_id)
    if slot["status"] not in ("cleanup_blocked", "disabled"):
        raise AdminError(409, "slot_not_repairable", f"slot {slot_id} is {slot['status']}",
                         {"status": slot["status"]})
    if slot["claimed"]:
        raise AdminError(409, "slot_in_use", f"slot {slot_id} still has a live claim")
    evidence = body.nvme_evidence.model_dump() if body.nvme_evidence else (
        json.loads(slot["nvme_evidence"]) if slot["nvme_evidence"] else None)
    others = await conn.fetch("SELECT * FROM node_resource_slots WHERE node_id = $1 AND slot_id <> $2 "
                              "AND status <> 'retired'", slot["node_id"], slot_id)
    problems = approval_problems({**slot, "nvme_evidence": evidence}, [dict(o) for o in others])
    if problems:
        raise AdminError(409, "repair_rejected", "the slot still fails approval rules", {"problems": problems})
    if body.nvme_evidence:
        await conn.execute("UPDATE node_resource_slots SET nvme_evidence = $2::jsonb WHERE slot_id = $1",
                           slot_id, json.dumps(evidence))
    await inv.move_slots(conn, [slot_id], "available", None, actor=body.actor,
                         detail={"repair_reason": body.reason, "from": slot["status"]},
                         health=("healthy", f"repaired by {body.actor}: {body.reason}"))
    await audit(conn, body.actor, "slot.repair", slot_id, body.reason, {"from": slot["status"]})
    await inv.refresh_nodes(conn, [slot["node_id"]])
    return await get_slot(conn, slot_id)


async def set_quota(conn: asyncpg.Connection, tenant_id: str, body: QuotaIn) -> dict:
    if not re.match(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$", tenant_id):
        raise AdminError(422, "invalid_tenant", "tenant id is not an identifier")
    await conn.execute(
        "INSERT INTO tenant_quotas (tenant_id, max_gpus, updated_by, reason) VALUES ($1, $2, $3, $4) "
        "ON CONFLICT (tenant_id) DO UPDATE SET max_gpus = EXCLUDED.max_gpus, updated_by = EXCLUDED.updated_by, "
        "reason = EXCLUDED.reason, updated_at = now()",
        tenant_id, body.max_gpus, body.actor, body.reason,
    )
    await audit(conn, body.actor, "tenant.quota", tenant_id, body.reason, {"max_gpus": body.max_gpus})
    return await get_quota(conn, tenant_id)


async def get_quota(conn: asyncpg.Connection, tenant_id: str) -> dict:
    row = await conn.fetchrow("SELECT tenant_id, max_gpus, updated_by, reason, updated_at FROM tenant_quotas "
                              "WHERE tenant_id = $1", tenant_id)
    used = await conn.fetchval("SELECT COALESCE(sum(gpus), 0) FROM allocation_resource_claims "
                               "WHERE tenant_id = $1 AND status <> 'released'", tenant_id)
    return {"tenant_id": tenant_id, "quota": _jsonable(row) if row else None, "gpus_in_use": used}
