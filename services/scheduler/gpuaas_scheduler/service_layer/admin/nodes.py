"""Nodes: registration (its first mode only), approval-gate waivers, drain and undrain (out of maintenance: the
host's wipe proof owed for its slots' disks): each a command on the node's `Host` (domain/host.py).

There is no way to write a node's parity or preflight by hand: they are the host's evidence, from its agent and
from MAAS commissioning. An operator who must approve slots past a failing gate records a waiver instead."""

from __future__ import annotations

from typing import Any

from ...adapters.inventory import TAG_SLICE
from ...domain.readiness_gate import waiver_problems
from ..hosts import publish
from ..ports import AdminNodes, AdminUnitOfWork, HostUnitOfWork
from ..slot_wipe import new_task_id
from .common import action_view, jsonable, load_host, node_not_found, require_node
from .models import Acted, AdminError, DrainIn, NodeIn, WaiverIn


async def list_nodes(nodes: AdminNodes, region: str | None = None, sku: str | None = None) -> dict[str, Any]:
    return {"nodes": [jsonable(r) for r in await nodes.listing(region, sku)]}


async def get_node(nodes: AdminNodes, node_id: str) -> dict[str, Any]:
    row = await nodes.view(node_id)
    if row is None:
        raise node_not_found(node_id)
    walks = await nodes.walks(node_id, 5)
    return {
        "node": jsonable(row),
        "live_claims": [jsonable(c) for c in await nodes.live_claims(node_id)],
        "mode_history": [jsonable(h) for h in await nodes.mode_history(node_id)],
        "waivers": [jsonable(w) for w in await nodes.waivers(node_id)],
        "actions": [action_view(a) for a in await nodes.actions(node_id)],
        # The walks back to slice mode, newest first, each with its steps: where a converting host stands.
        "walks": [jsonable(w) | {"steps": [jsonable(st) for st in w["steps"]]} for w in walks],
    }


def _registration(body: NodeIn) -> dict[str, Any]:
    """The node's row as registration writes it: its profile intent from its MAAS tags, its first mode."""
    declared = body.model_dump(include={"node_id", "kind", "hostname", "region", "pool", "sku", "maas_system_id"})
    return {
        **declared,
        "profile_intent": "slice-vm" if TAG_SLICE in body.maas_tags else "baremetal",
        "maas_tags": list(body.maas_tags),
        "mode": body.mode or ("slice" if body.kind == "slice_host" else "baremetal"),
        "gpu_count": body.gpu_count,
    }


async def upsert_node(uow: AdminUnitOfWork, body: NodeIn) -> dict[str, Any]:
    nodes = uow.repos.node_admin
    current = await nodes.lock_mode(body.node_id)
    if current is not None and body.mode is not None and body.mode != current:
        # Registration sets the first mode only; later changes have guards and a history.
        raise AdminError(
            409,
            "mode_transition_refused",
            f"node {body.node_id} is {current}: change its mode with POST /v1/nodes/{{node_id}}/mode",
            {"from": current, "to": body.mode},
        )
    await nodes.register(_registration(body))
    if current is None:
        await nodes.record_created(body.node_id, body.actor, "registered through the admin API")
    await uow.repos.audit.record(body.actor, "node.upsert", body.node_id, None, body.model_dump(exclude={"actor"}))
    await uow.repos.nodes.refresh([body.node_id])
    return await get_node(nodes, body.node_id)


async def add_waiver(uow: AdminUnitOfWork, node_id: str, body: WaiverIn) -> dict[str, Any]:
    nodes = uow.repos.node_admin
    await require_node(nodes, node_id)
    problems = waiver_problems(body.gate, body.reason, body.expires_at, await nodes.now())
    if problems:
        raise AdminError(422, "waiver_refused", "; ".join(problems), {"problems": problems})
    assert body.reason is not None and body.expires_at is not None
    row = await nodes.add_waiver(node_id, body.gate, body.actor, body.reason.strip(), body.expires_at)
    detail = {"waiver_id": row["waiver_id"], "gate": body.gate, "expires_at": body.expires_at.isoformat()}
    await uow.repos.audit.record(body.actor, "node.waiver", node_id, body.reason, detail)
    return await get_node(nodes, node_id)


async def drain(uow: HostUnitOfWork, node_id: str, body: DrainIn) -> dict[str, Any]:
    host = await load_host(uow, node_id)
    host.drain(body.reason, actor=body.actor, maintenance=body.maintenance)
    await uow.repos.hosts.save(host)
    await uow.repos.audit.record(body.actor, "node.drain", node_id, body.reason, {"maintenance": body.maintenance})
    return {}


async def undrain(uow: HostUnitOfWork, node_id: str, body: Acted) -> dict[str, Any]:
    """Placements again. A node back from maintenance first owes its host's wipe proof for its slots' disks (a
    technician may have swapped or touched them): its free slots wait `awaiting_wipe`, asked in this transaction.
    What the response adds to the node's view: the wipe asked, out of maintenance."""
    host = await load_host(uow, node_id)
    ended = host.undrain(body.reason, actor=body.actor, wipe_task=new_task_id())
    await publish(uow, node_id, await uow.repos.hosts.save(host), slots_cause="maintenance")
    wipes = ended.view() if ended is not None else {}
    detail = {"maintenance": True, **wipes} if ended is not None else None
    await uow.repos.audit.record(body.actor, "node.undrain", node_id, body.reason, detail)
    return wipes
