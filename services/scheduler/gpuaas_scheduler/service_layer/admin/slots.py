"""Slots: candidates, their approval into slots, retirement, disable and repair.

Approval (re)writes a slot's binding under the rule of domain/slots.py's `check_approval`; every other
status change goes through `inventory.move_slots` and the slot transition table."""

from __future__ import annotations

import json
from typing import Any

import asyncpg

from gpuaas_common.outbox import EventCollector

from ...adapters import admin_nodes as audit_repo
from ...adapters import admin_slots as repo
from ...adapters import evidence as evidence_repo
from ...adapters import inventory as inv
from ...adapters import slot_wipes as wipes_repo
from ...adapters import wipe_policy as wipe_repo
from ...domain.approval import DEFAULT_WIPE_POLICY, approval_problems, binding_problems
from ...domain.host_mode import BAREMETAL, RETIRED, SLICE
from ...domain.readiness_gate import approval_gate
from ...domain.slot_wipe import AWAITING_WIPE, DiskFacts, approval_status, wipe_owed
from ...domain.slots import APPROVAL_REPLACES, IN_USE, allowed_from
from .. import host_modes
from ..slot_announcements import announce_nodes
from ..slot_wipe import ask_wipe
from ..vfio_binding import ask_binding
from .common import jsonable, lock_node, require_all
from .models import Acted, AdminError, ApproveIn, CandidatesIn, RepairIn, RetireIn


async def list_slots(conn: asyncpg.Connection, node_id: str | None = None, status: str | None = None) -> dict:
    return {"slots": [jsonable(r) for r in await repo.list_slots(conn, node_id, status)]}


async def get_slot(conn: asyncpg.Connection, slot_id: str) -> dict:
    row = await repo.slot_view(conn, slot_id)
    if row is None:
        raise AdminError(404, "slot_not_found", f"no slot {slot_id!r}")
    history = await repo.slot_history(conn, slot_id)
    wipes = [
        jsonable(w) | {"report": json.loads(w["report"]) if w["report"] else None}
        for w in await wipes_repo.of_slot(conn, slot_id)
    ]
    return {"slot": jsonable(row), "transitions": [jsonable(h) for h in history], "wipes": wipes}


async def list_candidates(conn: asyncpg.Connection, node_id: str) -> dict:
    if not await evidence_repo.node_exists(conn, node_id):
        raise AdminError(404, "node_not_found", f"no node {node_id!r}")
    return {"candidates": [jsonable(r) for r in await repo.list_candidates(conn, node_id)]}


async def upsert_candidates(conn: asyncpg.Connection, node_id: str, body: CandidatesIn) -> dict:
    await lock_node(conn, node_id)
    ids = [c.candidate_id for c in body.candidates]
    if len(set(ids)) != len(ids):
        raise AdminError(422, "duplicate_candidate", "candidate ids repeat within the request")
    others = await repo.candidates_elsewhere(conn, ids, node_id)
    if others:
        raise AdminError(409, "candidate_on_other_node", "candidate ids belong to another node", {"candidates": others})
    for c in body.candidates:
        fields = {f: getattr(c, f) for f in repo.CANDIDATE_FIELDS}
        evidence = c.nvme_evidence.model_dump() if c.nvme_evidence else None
        try:
            await repo.upsert_candidate(conn, node_id, c.candidate_id, fields, evidence, body.source)
        except repo.GpuAlreadyCandidate:
            raise AdminError(
                409,
                "gpu_already_a_candidate",
                f"GPU {c.gpu_pci_address} of {node_id} is already another candidate",
                {"candidate_id": c.candidate_id},
            ) from None
    await audit_repo.audit(conn, body.actor, "candidates.upsert", node_id, None, {"candidate_ids": ids})
    return await list_candidates(conn, node_id)


EMULATED_REFUSED = (
    "emulated slot (no GPU, no fabric VF): this scheduler does not allow emulated slots "
    "(GPUAAS_ALLOW_EMULATED_SLOTS, labs only)"
)


async def approve(
    conn: asyncpg.Connection,
    node_id: str,
    body: ApproveIn,
    *,
    events: EventCollector,
    allow_emulated: bool = False,
) -> dict:
    """Turn candidates into slots: `available` when every rule holds, else `disabled` with the reasons.
    On a converting host this is the re-approval that, with rediscovery and a passing parity run,
    returns it to slice mode. An emulated candidate (a lab host's) becomes available only where the
    scheduler allows emulated slots (`allow_emulated`, its setting)."""
    node = await lock_node(conn, node_id)
    if node["mode"] in (BAREMETAL, RETIRED):
        raise AdminError(
            409,
            "mode_forbids_approval",
            f"node {node_id} is {node['mode']}: a slot there would promise a baremetal or retired host's "
            "GPU and disk to slices; move it to converting and rediscover it first",
            {"mode": node["mode"]},
        )
    cands = await repo.list_candidates(conn, node_id, body.candidate_ids)
    require_all(body.candidate_ids, cands, "candidate_id", "candidate_not_found", "unknown candidates")
    if not cands:
        raise AdminError(404, "candidate_not_found", f"node {node_id} has no candidates to approve")
    waived = await _readiness_gate(conn, node, node_id)
    policy = await _approval_wipe_policy(conn, node["region"], body.destructive_wipe_policy)
    slots = {r["slot_id"]: dict(r) for r in await repo.node_slots(conn, node_id)}
    # The node's GPUs as they will be after this approval, which the module ID rule judges as a whole.
    batch_gpus = {c["gpu_pci_address"] for c in cands if c["gpu_pci_address"]}
    gpu_peers = [dict(c) for c in cands] + [
        s for s in slots.values() if s["status"] != RETIRED and s["gpu_pci_address"] not in batch_gpus
    ]
    results = []
    open_wipes = await wipes_repo.open_slot_ids(conn, list(slots))
    to_wipe: list[dict[str, Any]] = []
    for cand in cands:
        c = dict(cand)
        c["nvme_evidence"] = json.loads(c["nvme_evidence"]) if c["nvme_evidence"] else None
        existing = _replaced_slot(slots, c)
        slot_id = existing["slot_id"] if existing else c["candidate_id"]
        previous = existing["status"] if existing else None
        c["slot_id"] = slot_id
        c.update({f: getattr(body, f) for f in repo.STORAGE_FIELDS})
        c["destructive_wipe_policy"] = policy
        if body.profile is not None:
            c["profile"] = body.profile
        # A retired slot owns no binding any more; a re-approved one takes it back.
        problems = approval_problems(c, [s for s in slots.values() if s["status"] != RETIRED], gpu_peers)
        if c.get("emulated") and not allow_emulated:
            problems.append(EMULATED_REFUSED)
        owed = _wipe_owed(node["mode"], existing, c, slot_id in open_wipes)
        status, reason = approval_status(problems, owed)
        # Asked even of a slot approved disabled: its disk is proven clean before any later approval frees it.
        to_wipe += [{"slot_id": slot_id, "nvme_by_id": c["nvme_by_id"], "wipe_policy": policy}] if owed else []
        await repo.save_approval(
            conn,
            slot_id,
            node_id,
            c,
            previous=previous,
            status=status,
            reason=reason,
            actor=body.actor,
            log_reason=reason or body.reason,
            problems=problems,
        )
        slots[slot_id] = {**c, "status": status}
        results.append(
            {
                "candidate_id": c["candidate_id"],
                "slot_id": slot_id,
                "status": status,
                "problems": problems,
                **({"wipe_owed": owed} if owed else {}),
            }
        )
    wipe_task = await _ask_approval_wipes(conn, events, node_id, to_wipe, results, body.actor)
    await audit_repo.audit(
        conn,
        body.actor,
        "candidates.approve",
        node_id,
        body.reason,
        {"results": results, **({"waivers": waived} if waived else {})},
    )
    await inv.refresh_nodes(conn, [node_id])
    await announce_nodes(conn, events, [node_id], "approval", body.actor)
    mode, blockers = await host_modes.promote_if_ready(
        conn,
        node_id,
        actor=body.actor,
        reason=body.reason or "slots re-approved after rediscovery and a passing parity run",
        events=events,
    )
    out: dict[str, Any] = {"results": results, "mode": mode}
    if wipe_task:
        out["wipe_task"] = wipe_task
    # In slice mode (entered now, or already there with a changed approved set) the host binds what is approved.
    vfio_task = await ask_binding(conn, events, node_id, SLICE, mode) if mode == SLICE else None
    if vfio_task:
        out["vfio_task"] = vfio_task
    if waived:
        out["waived"] = waived
    if blockers:
        out["mode_blockers"] = blockers
    return out


async def _readiness_gate(conn: asyncpg.Connection, node: Any, node_id: str) -> list[dict]:
    """The waivers the gate used; refused (409) when the node is not ready for approval."""
    waivers = [w for w in await audit_repo.waivers(conn, node_id) if w["active"]]
    gate = approval_gate(node, {w["gate"] for w in waivers})
    if gate.problems:
        raise AdminError(
            409,
            "readiness_gate",
            f"node {node_id} is not ready for slot approval: " + "; ".join(gate.problems.values()),
            {"gates": gate.problems},
        )
    return [jsonable(w) for w in waivers if w["gate"] in gate.waived]


def _replaced_slot(slots: dict[str, dict], c: dict) -> dict | None:
    """The slot the candidate approves to (by GPU, else by id), refused when approval may not replace it."""
    existing = next(
        (s for s in slots.values() if s["gpu_pci_address"] and s["gpu_pci_address"] == c["gpu_pci_address"]), None
    ) or slots.get(c["candidate_id"])
    previous = existing["status"] if existing else None
    if existing is not None and previous not in APPROVAL_REPLACES:
        slot_id = existing["slot_id"]
        raise AdminError(
            409,
            "slot_in_use",
            f"slot {slot_id} is {previous}; approval cannot replace it"
            + (" (repair it instead)" if previous == "cleanup_blocked" else ""),
            {"slot_id": slot_id, "status": previous},
        )
    return existing


def _wipe_owed(mode: str, existing: dict | None, candidate: dict, wipe_open: bool) -> list[str]:
    return wipe_owed(
        DiskFacts(
            host_mode=mode,
            previous_status=existing["status"] if existing else None,
            previous_disk=existing["nvme_by_id"] if existing else None,
            disk=candidate["nvme_by_id"],
            wipe_open=wipe_open,
        )
    )


async def _ask_approval_wipes(
    conn: asyncpg.Connection,
    events: EventCollector,
    node_id: str,
    to_wipe: list[dict[str, Any]],
    results: list[dict[str, Any]],
    actor: str,
) -> str | None:
    why = "; ".join(sorted({w for r in results for w in r.get("wipe_owed", [])}))
    # A disk without a stable identity is no disk the agent may wipe; its slot is disabled by the binding rules.
    wipeable = [w for w in to_wipe if "/by-id/" in (w["nvme_by_id"] or "")]
    return await ask_wipe(conn, events, node_id, wipeable, cause="approval", why=why, actor=actor)


async def _approval_wipe_policy(conn: asyncpg.Connection, region: str, asked: str | None) -> str:
    """The site's policy when the region has one (a different one asked for is refused), else the one asked
    for, else blkdiscard."""
    site = await wipe_repo.site_policy(conn, region)
    if site is None:
        return asked or DEFAULT_WIPE_POLICY
    if asked is not None and asked != site["destructive_wipe_policy"]:
        raise AdminError(
            409,
            "wipe_policy_conflicts_with_site",
            f"site {region} requires {site['destructive_wipe_policy']} between tenants; change the site's policy "
            "rather than one slot's",
            {"site_policy": site["destructive_wipe_policy"], "asked": asked},
        )
    return str(site["destructive_wipe_policy"])


async def retire_slots(conn: asyncpg.Connection, node_id: str, body: RetireIn, *, events: EventCollector) -> dict:
    """Slots that no longer promise their GPU and disk to slices (all of the node's unretired slots when
    slot_ids is absent), atomically. A host must have retired every slot before it may serve baremetal;
    only re-approval after rediscovery brings a retired slot back."""
    await lock_node(conn, node_id)
    rows = await repo.lock_node_slots(conn, node_id, body.slot_ids)
    require_all(body.slot_ids, rows, "slot_id", "slot_not_found", f"slots not on node {node_id}")
    busy = {
        r["slot_id"]: r["status"]
        for r in rows
        if r["claimed"] or r["status"] in IN_USE | {"cleanup_blocked", AWAITING_WIPE}
    }
    if busy:
        # A cleanup_blocked disk may still hold a tenant's data: retiring it would hand that data to
        # whoever gets the host next. It needs a verified wipe (repair) first.
        raise AdminError(
            409, "slot_in_use", "slots in use or awaiting a verified wipe cannot be retired", {"slots": busy}
        )
    ids = [r["slot_id"] for r in rows if r["status"] != RETIRED]
    await inv.move_slots(conn, ids, RETIRED, body.reason, actor=body.actor)
    await audit_repo.audit(conn, body.actor, "slots.retire", node_id, body.reason, {"slot_ids": ids})
    await inv.refresh_nodes(conn, [node_id])
    if ids:
        await announce_nodes(conn, events, [node_id], "retire", body.actor)
    return await list_slots(conn, node_id=node_id)


async def _lock_slot(conn: asyncpg.Connection, slot_id: str) -> dict:
    node_id = await repo.slot_node(conn, slot_id)
    if node_id is None:
        raise AdminError(404, "slot_not_found", f"no slot {slot_id!r}")
    await lock_node(conn, node_id)
    return dict(await repo.lock_slot(conn, slot_id))


async def disable(conn: asyncpg.Connection, slot_id: str, body: Acted, *, events: EventCollector) -> dict:
    slot = await _lock_slot(conn, slot_id)
    if slot["status"] == RETIRED:
        raise AdminError(409, "slot_retired", f"slot {slot_id} is retired; only re-approval brings it back")
    if slot["claimed"] or slot["status"] in IN_USE:
        raise AdminError(
            409, "slot_in_use", f"slot {slot_id} is {slot['status']} under a live claim", {"status": slot["status"]}
        )
    if slot["status"] == "disabled":
        return await get_slot(conn, slot_id)  # already where it was asked to be
    if slot["status"] not in allowed_from("disabled"):
        # e.g. cleanup_blocked: tenant data may remain, and a disabled slot could be repaired by
        # anyone later without the wipe that cleanup_blocked demands.
        raise AdminError(
            409,
            "slot_not_disableable",
            f"slot {slot_id} is {slot['status']}; it cannot be disabled",
            {"status": slot["status"]},
        )
    await inv.move_slots(conn, [slot_id], "disabled", body.reason, actor=body.actor)
    await audit_repo.audit(conn, body.actor, "slot.disable", slot_id, body.reason)
    await inv.refresh_nodes(conn, [slot["node_id"]])
    await announce_nodes(conn, events, [slot["node_id"]], "disable", body.actor)
    return await get_slot(conn, slot_id)


async def repair(conn: asyncpg.Connection, slot_id: str, body: RepairIn, *, events: EventCollector) -> dict:
    """disabled -> available if the approval rules hold now (new disk evidence can come with the request);
    cleanup_blocked: the slot's host is asked to wipe its disk by the site's policy (slice.slot_wipe) and the slot
    stays blocked until that host's own proof arrives and passes (service_layer/slot_wipe.py). A wipe proof in the
    body is refused: nobody types a proof."""
    if body.wipe_proof is not None:
        raise AdminError(
            422,
            "typed_wipe_proof_refused",
            "a wipe proof is accepted only from the slot's own host over the bus; repair asks the host to wipe",
        )
    slot = await _lock_slot(conn, slot_id)
    if slot["status"] not in ("cleanup_blocked", "disabled", AWAITING_WIPE):
        raise AdminError(409, "slot_not_repairable", f"slot {slot_id} is {slot['status']}", {"status": slot["status"]})
    if slot["claimed"]:
        raise AdminError(409, "slot_in_use", f"slot {slot_id} still has a live claim")
    if slot["status"] in ("cleanup_blocked", AWAITING_WIPE):
        # awaiting_wipe too: a wipe task lost or past its deadline is asked again, never skipped.
        return await _repair_blocked(conn, slot, body, events=events)
    if slot_id in await wipes_repo.open_slot_ids(conn, [slot_id]):
        raise AdminError(
            409,
            "awaiting_wipe_proof",
            f"slot {slot_id}'s disk awaits its host's wipe proof; it is repaired once that proof passes",
        )
    evidence = (
        body.nvme_evidence.model_dump()
        if body.nvme_evidence
        else (json.loads(slot["nvme_evidence"]) if slot["nvme_evidence"] else None)
    )
    others = await repo.other_unretired_slots(conn, slot["node_id"], slot_id)
    problems = approval_problems({**slot, "nvme_evidence": evidence}, [dict(o) for o in others])
    if problems:
        raise AdminError(409, "repair_rejected", "the slot still fails approval rules", {"problems": problems})
    if body.nvme_evidence:
        await repo.set_nvme_evidence(conn, slot_id, evidence)
    await inv.move_slots(
        conn,
        [slot_id],
        "available",
        None,
        actor=body.actor,
        detail={"repair_reason": body.reason, "from": slot["status"]},
        health=("healthy", f"repaired by {body.actor}: {body.reason}"),
    )
    await audit_repo.audit(conn, body.actor, "slot.repair", slot_id, body.reason, {"from": slot["status"]})
    await inv.refresh_nodes(conn, [slot["node_id"]])
    await announce_nodes(conn, events, [slot["node_id"]], "repair", body.actor)
    return await get_slot(conn, slot_id)


async def _repair_blocked(conn: asyncpg.Connection, slot: dict, body: RepairIn, *, events: EventCollector) -> dict:
    slot_id = slot["slot_id"]
    if body.nvme_evidence is not None:
        raise AdminError(
            422,
            "typed_evidence_refused",
            f"slot {slot_id} is {slot['status']}: its disk is proven clean only by its host's wipe, "
            "not by typed evidence",
        )
    problems = binding_problems(slot)
    if problems or "/by-id/" not in (slot["nvme_by_id"] or ""):
        raise AdminError(409, "repair_rejected", "the slot still fails approval rules", {"problems": problems})
    policy = dict(await wipe_repo.slot_policy(conn, slot_id) or {})
    task_id = await ask_wipe(
        conn,
        events,
        slot["node_id"],
        [
            {
                "slot_id": slot_id,
                "nvme_by_id": slot["nvme_by_id"],
                "wipe_policy": policy.get("destructive_wipe_policy") or DEFAULT_WIPE_POLICY,
            }
        ],
        cause="repair",
        why=f"repair by {body.actor}: {body.reason}",
        actor=body.actor,
    )
    await audit_repo.audit(
        conn, body.actor, "slot.repair", slot_id, body.reason, {"from": slot["status"], "wipe_task": task_id}
    )
    return {**(await get_slot(conn, slot_id)), "wipe_task": task_id}
