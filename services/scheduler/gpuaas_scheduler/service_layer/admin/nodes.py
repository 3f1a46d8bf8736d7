"""Nodes: registration (its first mode only), approval-gate waivers, drain and undrain (out of maintenance: the
host's wipe proof owed for its slots' disks): each a command on the node's `Host` (domain/host.py).

There is no way to write a node's parity or preflight by hand: they are the host's evidence, from its agent and
from MAAS commissioning. An operator who must approve slots past a failing gate records a waiver instead."""

from __future__ import annotations

import asyncpg

from ...adapters import admin_nodes as repo
from ...adapters import host_modes as mode_repo
from ...adapters import host_walk as walk_repo
from ...adapters import inventory as inv
from ...adapters import node_actions as actions_repo
from ...domain.readiness_gate import waiver_problems
from ..hosts import publish
from ..ports import HostUnitOfWork
from ..slot_wipe import new_task_id
from .common import action_view, jsonable, load_host, lock_node
from .models import Acted, AdminError, DrainIn, NodeIn, WaiverIn


async def list_nodes(conn: asyncpg.Connection, region: str | None = None, sku: str | None = None) -> dict:
    return {"nodes": [jsonable(r) for r in await repo.list_nodes(conn, region, sku)]}


async def get_node(conn: asyncpg.Connection, node_id: str) -> dict:
    row = await repo.node_view(conn, node_id)
    if row is None:
        raise AdminError(404, "node_not_found", f"no node {node_id!r}")
    claims = await repo.live_claims(conn, node_id)
    history = await mode_repo.history(conn, node_id)
    waivers = await repo.waivers(conn, node_id)
    asks = await actions_repo.history(conn, node_id)
    walks = await walk_repo.history(conn, node_id, limit=5)
    return {
        "node": jsonable(row),
        "live_claims": [jsonable(c) for c in claims],
        "mode_history": [jsonable(h) for h in history],
        "waivers": [jsonable(w) for w in waivers],
        "actions": [action_view(a) for a in asks],
        # The walks back to slice mode, newest first, each with its steps: where a converting host stands.
        "walks": [jsonable(w) | {"steps": [jsonable(st) for st in w["steps"]]} for w in walks],
    }


async def upsert_node(conn: asyncpg.Connection, body: NodeIn) -> dict:
    intent = "slice-vm" if inv.TAG_SLICE in body.maas_tags else "baremetal"
    current = await repo.lock_node_mode(conn, body.node_id)
    if current is not None and body.mode is not None and body.mode != current:
        # Registration sets the first mode only; later changes have guards and a history.
        raise AdminError(
            409,
            "mode_transition_refused",
            f"node {body.node_id} is {current}: change its mode with POST /v1/nodes/{{node_id}}/mode",
            {"from": current, "to": body.mode},
        )
    mode = body.mode or ("slice" if body.kind == "slice_host" else "baremetal")
    await repo.upsert_node(
        conn,
        node_id=body.node_id,
        kind=body.kind,
        hostname=body.hostname,
        region=body.region,
        pool=body.pool,
        sku=body.sku,
        maas_system_id=body.maas_system_id,
        profile_intent=intent,
        maas_tags=body.maas_tags,
        mode=mode,
        gpu_count=body.gpu_count,
    )
    if current is None:
        await mode_repo.record_created(conn, [body.node_id], body.actor, "registered through the admin API")
    await repo.audit(conn, body.actor, "node.upsert", body.node_id, None, body.model_dump(exclude={"actor"}))
    await inv.refresh_nodes(conn, [body.node_id])
    return await get_node(conn, body.node_id)


async def add_waiver(conn: asyncpg.Connection, node_id: str, body: WaiverIn) -> dict:
    await lock_node(conn, node_id)
    now = await conn.fetchval("SELECT now()")
    problems = waiver_problems(body.gate, body.reason, body.expires_at, now)
    if problems:
        raise AdminError(422, "waiver_refused", "; ".join(problems), {"problems": problems})
    assert body.reason is not None and body.expires_at is not None
    row = await repo.insert_waiver(conn, node_id, body.gate, body.actor, body.reason.strip(), body.expires_at)
    await repo.audit(
        conn,
        body.actor,
        "node.waiver",
        node_id,
        body.reason,
        {"waiver_id": row["waiver_id"], "gate": body.gate, "expires_at": body.expires_at.isoformat()},
    )
    return await get_node(conn, node_id)


async def drain(uow: HostUnitOfWork, node_id: str, body: DrainIn) -> dict:
    host = await load_host(uow, node_id)
    host.drain(body.reason, actor=body.actor, maintenance=body.maintenance)
    await uow.repos.hosts.save(host)
    await uow.repos.audit.record(body.actor, "node.drain", node_id, body.reason, {"maintenance": body.maintenance})
    return {}


async def undrain(uow: HostUnitOfWork, node_id: str, body: Acted) -> dict:
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
