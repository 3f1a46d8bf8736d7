"""Admin HTTP API of the scheduler (documented in services/scheduler/openapi.yaml).

Bearer-token auth; every mutation needs an `Idempotency-Key`, and its response is stored in the same
transaction as the change, so a retried request replays the first answer instead of acting twice.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Awaitable, Callable
from typing import Any

import asyncpg
from aiohttp import web
from pydantic import BaseModel, SecretStr, ValidationError

from gpuaas_common.logging import bound_context, get_logger

from ..service_layer import admin as ops
from ..service_layer.admin import AdminError

log = get_logger(__name__)
POOL = web.AppKey("pool", asyncpg.Pool)
TOKEN = web.AppKey("token", SecretStr)


def error_response(status: int, code: str, message: str, details: dict | None = None) -> web.Response:
    return web.json_response({"error": {"code": code, "message": message, "details": details or {}}}, status=status)


@web.middleware
async def errors_and_auth(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]):
    expected = request.app[TOKEN].get_secret_value().encode()
    given = request.headers.get("Authorization", "")
    token = given[7:].encode() if given.startswith("Bearer ") else b""
    if not token or not hmac.compare_digest(token, expected):
        return error_response(401, "unauthorized", "a valid bearer token is required")
    with bound_context(admin_method=request.method, admin_path=request.path):
        try:
            return await handler(request)
        except AdminError as exc:
            log.info("admin_rejected", code=exc.code, status=exc.status)
            return error_response(exc.status, exc.code, exc.message, exc.details)
        except web.HTTPException:
            raise
        except Exception as exc:  # the client gets a structured 500, the log the traceback
            log.error("admin_failed", error=repr(exc), exc_info=True)
            return error_response(500, "internal", "internal error")


async def _body(request: web.Request, model: type[BaseModel]) -> BaseModel:
    try:
        raw = await request.json()
    except ValueError:
        raise AdminError(400, "invalid_json", "request body is not JSON") from None
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        errors = [{"loc": ".".join(map(str, e["loc"])), "msg": e["msg"]} for e in exc.errors()[:20]]
        raise AdminError(422, "invalid_request", "request body does not match the schema", {"errors": errors}) from None


def read(fn: Callable[..., Awaitable[dict]], *path_args: str, query: tuple[str, ...] = ()):
    async def handler(request: web.Request) -> web.Response:
        args = [request.match_info[a] for a in path_args]
        kwargs = {q: request.query.get(q) for q in query}
        async with request.app[POOL].acquire() as conn:
            return web.json_response(await fn(conn, *args, **kwargs))

    return handler


def write(fn: Callable[..., Awaitable[dict]], model: type[BaseModel], *path_args: str, status: int = 200):
    async def handler(request: web.Request) -> web.Response:
        key = request.headers.get("Idempotency-Key", "")
        if not key or len(key) > 200:
            raise AdminError(400, "idempotency_key_required", "mutations need an Idempotency-Key header (1-200 chars)")
        raw = await request.read()
        digest = hashlib.sha256(b"\0".join([request.method.encode(), request.path.encode(), raw])).hexdigest()
        body = await _body(request, model)
        args = [request.match_info[a] for a in path_args]
        async with request.app[POOL].acquire() as conn, conn.transaction():
            # Serialise requests carrying the same key: the second one waits and then replays.
            await conn.execute("SELECT pg_advisory_xact_lock(hashtext('gpuaas-admin-idem:' || $1))", key)
            prior = await conn.fetchrow("SELECT * FROM admin_idempotency WHERE key = $1", key)
            if prior is not None:
                if prior["request_hash"] != digest:
                    raise AdminError(422, "idempotency_key_reused", "this Idempotency-Key was used for another request",
                                     {"method": prior["method"], "path": prior["path"]})
                log.info("admin_replayed", actor=getattr(body, "actor", None))
                return web.json_response(json.loads(prior["response"]), status=prior["status_code"],
                                         headers={"Idempotent-Replayed": "true"})
            result = await fn(conn, *args, body)
            await conn.execute(
                "INSERT INTO admin_idempotency (key, method, path, request_hash, status_code, response) "
                "VALUES ($1, $2, $3, $4, $5, $6::jsonb)",
                key, request.method, request.path, digest, status, json.dumps(result),
            )
        log.info("admin_mutation", actor=getattr(body, "actor", None), target=args)
        return web.json_response(result, status=status)

    return handler


def build_app(pool: asyncpg.Pool, token: SecretStr) -> web.Application:
    app = web.Application(middlewares=[errors_and_auth], client_max_size=1 << 20)
    app[POOL] = pool
    app[TOKEN] = token
    r = app.router
    r.add_get("/v1/nodes", read(ops.list_nodes, query=("region", "sku")))
    r.add_post("/v1/nodes", write(ops.upsert_node, ops.NodeIn))
    r.add_get("/v1/nodes/{node_id}", read(ops.get_node, "node_id"))
    r.add_put("/v1/nodes/{node_id}/readiness", write(ops.set_readiness, ops.ReadinessIn, "node_id"))
    r.add_post("/v1/nodes/{node_id}/drain", write(ops.drain, ops.DrainIn, "node_id"))
    r.add_post("/v1/nodes/{node_id}/undrain", write(ops.undrain, ops.Acted, "node_id"))
    r.add_get("/v1/nodes/{node_id}/mode", read(ops.get_mode, "node_id"))
    r.add_post("/v1/nodes/{node_id}/mode", write(ops.set_mode, ops.ModeIn, "node_id"))
    r.add_get("/v1/nodes/{node_id}/slots", read(_node_slots, "node_id"))
    r.add_post("/v1/nodes/{node_id}/slots/retire", write(ops.retire_slots, ops.RetireIn, "node_id"))
    r.add_get("/v1/nodes/{node_id}/candidates", read(ops.list_candidates, "node_id"))
    r.add_put("/v1/nodes/{node_id}/candidates", write(ops.upsert_candidates, ops.CandidatesIn, "node_id"))
    r.add_post("/v1/nodes/{node_id}/candidates/approve", write(ops.approve, ops.ApproveIn, "node_id"))
    r.add_get("/v1/slots", read(ops.list_slots, query=("node_id", "status")))
    r.add_get("/v1/slots/{slot_id}", read(ops.get_slot, "slot_id"))
    r.add_post("/v1/slots/{slot_id}/disable", write(ops.disable, ops.Acted, "slot_id"))
    r.add_post("/v1/slots/{slot_id}/repair", write(ops.repair, ops.RepairIn, "slot_id"))
    r.add_get("/v1/tenants/{tenant_id}/quota", read(ops.get_quota, "tenant_id"))
    r.add_put("/v1/tenants/{tenant_id}/quota", write(ops.set_quota, ops.QuotaIn, "tenant_id"))
    return app


async def _node_slots(conn: asyncpg.Connection, node_id: str) -> dict[str, Any]:
    await ops.get_node(conn, node_id)
    return await ops.list_slots(conn, node_id=node_id)


async def start_admin(pool: asyncpg.Pool, token: SecretStr, host: str, port: int) -> tuple[web.AppRunner, int]:
    runner = web.AppRunner(build_app(pool, token), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, bound
