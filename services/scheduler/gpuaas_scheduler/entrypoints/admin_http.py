"""Admin HTTP API of the scheduler, on the shared stack (`gpuaas_common.admin_http`: bearer auth, one
error shape, Idempotency-Key and an audit row per mutation, all in one unit of work).

`services/scheduler/openapi.yaml` is rendered from `ROUTES`:
`python -m gpuaas_scheduler.entrypoints.admin_http services/scheduler/openapi.yaml`.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import asyncpg
from pydantic import BaseModel, SecretStr

from gpuaas_common.admin_http import AdminApi, Call, Route, openapi, render_yaml

from ..adapters.repository import SchedulerRepositories, scheduler_repositories
from ..service_layer import admin as ops
from ..service_layer import steering
from ..service_layer.admin import drift as drift_ops
from ..service_layer.steering import SteeringPolicy
from . import api_models as out

SCHEMA = "scheduler"
APPROVE_PATH = "/v1/nodes/{node_id}/candidates/approve"


def read(fn: Callable[..., Awaitable[dict]], *, query: tuple[str, ...] = ()) -> Callable[[Call], Awaitable[dict]]:
    async def handler(call: Call) -> dict:
        return await fn(call.conn, *call.params.values(), **call.query)

    return handler


def write(fn: Callable[..., Awaitable[dict]]) -> Callable[[Call], Awaitable[dict]]:
    async def handler(call: Call) -> dict:
        return await fn(call.conn, *call.params.values(), call.body)

    return handler


def write_asking(fn: Callable[..., Awaitable[dict]]) -> Callable[[Call], Awaitable[dict]]:
    """A mutation that raises events through its unit of work's outbox (a VFIO binding's node task, a host's
    slots announced)."""

    async def handler(call: Call) -> dict:
        assert call.uow is not None
        return await fn(call.conn, *call.params.values(), call.body, events=call.uow.events)

    return handler


def read_port(
    fn: Callable[..., Awaitable[dict]], port: Callable[[SchedulerRepositories], Any]
) -> Callable[[Call], Awaitable[dict]]:
    """A read through one of the repositories (`port` picks it) on the read's connection."""

    async def handler(call: Call) -> dict:
        return await fn(port(scheduler_repositories(call.conn)), *call.params.values(), **call.query)

    return handler


def change(fn: Callable[..., Awaitable[dict]]) -> Callable[[Call], Awaitable[dict]]:
    """A mutation on the unit of work's repositories, answered with what it returns."""

    async def handler(call: Call) -> dict:
        assert call.uow is not None
        return await fn(call.uow, *call.params.values(), call.body)

    return handler


def _nodes(repos: SchedulerRepositories) -> Any:
    return repos.node_admin


def command(
    fn: Callable[..., Awaitable[dict]], view: Callable[..., Awaitable[dict]]
) -> Callable[[Call], Awaitable[dict]]:
    """A command on the unit of work's repositories (load, one method, save), answered with what `view` reads
    after it and what the command adds to that."""

    async def handler(call: Call) -> dict:
        assert call.uow is not None
        params = list(call.params.values())
        added = await fn(call.uow, *params, call.body)
        return await view(call.uow.repos.node_admin, *params) | added

    return handler


async def _node_slots(conn: asyncpg.Connection, node_id: str) -> dict[str, Any]:
    await ops.get_node(scheduler_repositories(conn).node_admin, node_id)
    return await ops.list_slots(conn, node_id=node_id)


def steer(kind: str, policy: SteeringPolicy) -> Callable[[Call], Awaitable[dict]]:
    async def handler(call: Call) -> dict:
        assert call.uow is not None  # a mutation: its task goes out through the unit of work's outbox
        # steering's ask still takes the connection (service_layer/steering.py): bound here, out of the admin op.
        ask = functools.partial(steering.ask, call.conn, call.uow.events, policy)
        return await ops.steer(call.uow, ask, call.params["node_id"], kind, call.body)

    return handler


STEER_PATHS = {
    "rediscover": "/v1/nodes/{node_id}/rediscover",
    "parity": "/v1/nodes/{node_id}/parity",
    "commission": "/v1/nodes/{node_id}/commission",
}
STEER_SUMMARIES = {
    "rediscover": "ask the host's agent to rediscover its topology (and run parity); the reports close the ask",
    "parity": "ask the host's agent for a parity run now; its report closes the ask",
    "commission": "commission the machine through MAAS with the slice preflight; the preflight report closes the ask",
}


def steer_routes(policy: SteeringPolicy) -> list[Route]:
    return [
        Route("POST", path, steer(kind, policy), STEER_SUMMARIES[kind], out.SteerOut, ops.Acted, errors=(409,))
        for kind, path in STEER_PATHS.items()
    ]


def _r(
    method: str,
    path: str,
    handler,
    summary: str,
    response: type[BaseModel],
    body: type[BaseModel] | None = None,
    errors: tuple[int, ...] = (),
    query: tuple[str, ...] = (),
) -> Route:
    return Route(method, path, handler, summary, response, body, errors=errors, query=query)


ROUTES = [
    _r("GET", "/v1/nodes", read_port(ops.list_nodes, _nodes), "list nodes", out.NodeList, query=("region", "sku")),
    _r(
        "POST",
        "/v1/nodes",
        change(ops.upsert_node),
        "register or update a node (its first mode only)",
        out.NodeDetail,
        ops.NodeIn,
    ),
    _r(
        "GET",
        "/v1/nodes/{node_id}",
        read_port(ops.get_node, _nodes),
        "a node, its live claims and mode history",
        out.NodeDetail,
    ),
    _r(
        "POST",
        "/v1/nodes/{node_id}/waivers",
        change(ops.add_waiver),
        "waive one slot approval gate (parity or preflight) for a while: who, why, until when; the evidence stays",
        out.NodeDetail,
        ops.WaiverIn,
        errors=(422,),
    ),
    *steer_routes(SteeringPolicy()),
    _r(
        "POST",
        "/v1/nodes/{node_id}/drain",
        command(ops.drain, ops.get_node),
        "stop new placements on a node",
        out.NodeDetail,
        ops.DrainIn,
    ),
    _r(
        "POST",
        "/v1/nodes/{node_id}/undrain",
        command(ops.undrain, ops.get_node),
        "accept placements again; out of maintenance, its free slots await the host's wipe proof first",
        out.UndrainOut,
        ops.Acted,
    ),
    _r(
        "GET",
        "/v1/nodes/{node_id}/drift",
        read_port(drift_ops.list_drift, lambda r: r.drift_log),
        "drift the node agent reported (unresolved by default; status=open|acknowledged|resolved|all)",
        out.DriftList,
        query=("status",),
    ),
    _r(
        "POST",
        "/v1/nodes/{node_id}/drift/ack",
        change(drift_ops.ack_drift),
        "acknowledge open drift (all, or drift_ids): its slots or the node take placements again",
        out.DriftList,
        drift_ops.DriftAckIn,
    ),
    _r(
        "GET",
        "/v1/nodes/{node_id}/mode",
        read_port(ops.get_mode, _nodes),
        "mode, what blocks each transition, history",
        out.ModeView,
    ),
    _r(
        "POST",
        "/v1/nodes/{node_id}/mode",
        command(ops.set_mode, ops.get_mode),
        "change the host mode (guarded)",
        out.ModeView,
        ops.ModeIn,
        errors=(409,),
    ),
    _r("GET", "/v1/nodes/{node_id}/slots", read(_node_slots), "a node's slots", out.SlotList),
    _r(
        "POST",
        "/v1/nodes/{node_id}/slots/retire",
        write_asking(ops.retire_slots),
        "retire slots (all unretired ones when slot_ids is absent), atomically",
        out.SlotList,
        ops.RetireIn,
    ),
    _r(
        "GET",
        "/v1/nodes/{node_id}/candidates",
        read(ops.list_candidates),
        "discovered slot candidates",
        out.CandidateList,
    ),
    _r(
        "PUT",
        "/v1/nodes/{node_id}/candidates",
        write(ops.upsert_candidates),
        "record slot candidates",
        out.CandidateList,
        ops.CandidatesIn,
    ),
    _r(
        "POST",
        APPROVE_PATH,
        write_asking(ops.approve),
        "turn candidates into slots (available only when every approval rule holds; awaiting_wipe, with the host "
        "asked to wipe, where the disk may hold someone else's data)",
        out.ApprovalOut,
        ops.ApproveIn,
    ),
    _r("GET", "/v1/slots", read(ops.list_slots), "list slots", out.SlotList, query=("node_id", "status")),
    _r("GET", "/v1/slots/{slot_id}", read(ops.get_slot), "a slot and its transitions", out.SlotDetail),
    _r(
        "POST",
        "/v1/slots/{slot_id}/disable",
        write_asking(ops.disable),
        "take a slot out of placement",
        out.SlotDetail,
        ops.Acted,
    ),
    _r(
        "POST",
        "/v1/slots/{slot_id}/repair",
        write_asking(ops.repair),
        "disabled -> available if the approval rules hold now; cleanup_blocked: asks the slot's host to wipe "
        "(slice.slot_wipe), freed only by that host's passing proof; a typed wipe_proof is refused",
        out.SlotDetail,
        ops.RepairIn,
    ),
    _r(
        "GET",
        "/v1/sites/{region}/wipe-policy",
        read_port(ops.get_site_wipe_policy, lambda r: r.wipe_policies),
        "the destructive wipe the site requires between tenants (null: each slot's approved policy)",
        out.SiteWipePolicyView,
    ),
    _r(
        "PUT",
        "/v1/sites/{region}/wipe-policy",
        change(ops.set_site_wipe_policy),
        "set the site's wipe policy: agents are told to use it, and a released slot is reused only with its proof",
        out.SiteWipePolicyView,
        ops.SiteWipePolicyIn,
    ),
    _r(
        "POST",
        "/v1/allocations/{allocation_id}/force-release",
        change(ops.force_release),
        "free an allocation's claims; refused while a VM may hold the devices unless forced; slots end cleanup_blocked",
        out.ForceReleaseOut,
        ops.ForceReleaseIn,
    ),
    _r(
        "GET",
        "/v1/tenants/{tenant_id}/quota",
        read_port(ops.get_quota, lambda r: r.quotas),
        "a tenant's GPU quota and use",
        out.QuotaView,
    ),
    _r(
        "PUT",
        "/v1/tenants/{tenant_id}/quota",
        change(ops.set_quota),
        "set a tenant's GPU quota",
        out.QuotaView,
        ops.QuotaIn,
    ),
]


def admin_api(
    pool: asyncpg.Pool,
    token: SecretStr | None,
    *,
    console_token: SecretStr | None = None,
    allow_emulated_slots: bool = False,
    steering: SteeringPolicy | None = None,
) -> AdminApi:
    """`token`: the `ops-admin` principal's (reads and changes). `console_token`: the ops console's (`ops-console`:
    it reads, and changes only with the signed assertion of a person signed in with `ops-admin` rights, audited
    under that person). `allow_emulated_slots`: the scheduler's setting, which only approval reads (a lab's
    emulated slots). `steering`: the deadlines and MAAS site the asks of a host are sent with."""
    routes = ROUTES
    if allow_emulated_slots:
        approve = write_asking(functools.partial(ops.approve, allow_emulated=True))
        routes = [dataclasses.replace(r, handler=approve) if r.path == APPROVE_PATH else r for r in routes]
    if steering is not None:
        mine = {r.path: r for r in steer_routes(steering)}
        routes = [mine.get(r.path, r) if r.method == "POST" else r for r in routes]
    return AdminApi(
        service="scheduler",
        schema=SCHEMA,
        pool=pool,
        tokens={"ops-admin": token, "ops-console": console_token},
        routes=routes,
        repositories=scheduler_repositories,
        document=openapi_document,
        # Every mutation's audit record also goes to the bus, for ops (ops-view's audit model).
        audit_event="scheduler.admin_request_recorded",
    )


def build_app(
    pool: asyncpg.Pool,
    token: SecretStr | None,
    *,
    console_token: SecretStr | None = None,
    allow_emulated_slots: bool = False,
    steering: SteeringPolicy | None = None,
):
    return admin_api(
        pool, token, console_token=console_token, allow_emulated_slots=allow_emulated_slots, steering=steering
    ).app()


def openapi_document() -> dict[str, Any]:
    return openapi(
        ROUTES,
        title="gpuaas scheduler admin API",
        version="1",
        description="Inventory administration: nodes, slot candidates and approval (the runbook's completeness "
        "rules), disable/repair, drain/undrain, host modes, rediscovery, parity and commissioning on demand, "
        "tenant quotas, site wipe policies, force-release. "
        "Every mutation needs an "
        "Idempotency-Key and is audited (admin_requests); errors share one shape.",
    )


if __name__ == "__main__":
    Path(sys.argv[1]).write_text(render_yaml(openapi_document()))
