"""The one admin HTTP stack of the services that have an admin API (scheduler, image pipeline).

A service declares `Route`s (method, path, pydantic request/response models, handler); this module owns
everything around them, identically for every service:

- bearer-token auth (constant-time; each token has an actor name, `X-Actor` may name the person);
- one error shape, `{"error": {"code", "message", "details", "request_id"}}`, for handler refusals,
  validation, auth, unknown routes, wrong methods and unhandled failures alike;
- a request id per request (`X-Request-Id` taken when well formed, else minted; echoed on every answer);
- every mutation (POST/PUT/PATCH/DELETE) needs an `Idempotency-Key`: the change, the stored answer, the
  audit row and any events commit in one `UnitOfWork`; the same key with the same request replays the
  stored answer, with another request is a 409 `idempotency_conflict`;
- an `admin_requests` row per authenticated mutation (who, what, when, request id), refusals included;
- the OpenAPI document rendered from the same routes and models, so it cannot drift from the code.

Tables `admin_idempotency` and `admin_requests` live in the service's own schema (its migrations).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import asyncpg
from aiohttp import web
from pydantic import BaseModel, ConfigDict, SecretStr, ValidationError
from pydantic.json_schema import models_json_schema

from .api_error import ApiError
from .logging import bound_context, get_logger
from .unit_of_work import UnitOfWork, no_repositories

log = get_logger(__name__)
__all__ = ["AdminApi", "ApiError", "Call", "Error", "Reply", "Route", "openapi", "render_yaml"]

MUTATIONS = frozenset({"POST", "PUT", "PATCH", "DELETE"})
KEY_RE = re.compile(r"^[\x21-\x7e]{1,200}$")
REQUEST_ID_RE = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
ACTOR_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:@-]{0,127}$")
MAX_BODY = 1 << 20
REQUEST_ID = web.RequestKey("request_id", str)
PRINCIPAL = web.RequestKey("principal", str)

# What every status means when a route lists it; the schema of each is the shared error shape.
STATUS_TEXT = {
    400: "malformed request: body is not JSON, or a header (Idempotency-Key, X-Actor) is missing or invalid",
    401: "missing or wrong bearer token",
    404: "the named resource does not exist",
    409: "refused in the current state, or the Idempotency-Key was used for another request",
    413: "request body over 1 MiB",
    422: "the request does not match its schema or the service's rules",
    500: "unexpected failure (nothing was committed)",
}


class ErrorBody(BaseModel):
    model_config = ConfigDict(title="ErrorBody")
    code: str
    message: str
    details: dict[str, Any]
    request_id: str


class Error(BaseModel):
    """The one error shape of every admin API."""

    model_config = ConfigDict(title="Error")
    error: ErrorBody


@dataclass
class Reply:
    """A handler's answer when its status is not the route's first one (e.g. 202 for queued work)."""

    body: Any
    status: int


@dataclass
class Call:
    """What a handler sees: its validated inputs, who asked, and where to do its work."""

    request: web.Request
    params: dict[str, str]
    query: dict[str, str | None]
    body: Any
    principal: str
    actor: str
    request_id: str
    conn: asyncpg.Connection
    uow: UnitOfWork | None = None
    after_commit: list[Callable[[], None]] = field(default_factory=list)


Handler = Callable[[Call], Awaitable[Any]]


@dataclass(frozen=True)
class Route:
    method: str
    path: str
    handler: Handler
    summary: str
    response: type[BaseModel]
    body: type[BaseModel] | None = None
    statuses: tuple[int, ...] = (200,)
    errors: tuple[int, ...] = ()
    query: tuple[str, ...] = ()
    body_required: bool = True

    @property
    def mutation(self) -> bool:
        return self.method in MUTATIONS

    @property
    def path_params(self) -> list[str]:
        return re.findall(r"\{(\w+)\}", self.path)

    def documented_errors(self) -> list[int]:
        out = {401, *self.errors}
        if self.path_params or self.query or self.body is not None:
            out.add(422)
        if self.path_params:
            out.add(404)
        if self.mutation:
            out |= {400, 409}
        return sorted(out)


def error_response(
    status: int,
    code: str,
    message: str,
    request_id: str,
    details: dict | None = None,
    headers: Mapping[str, str] | None = None,
) -> web.Response:
    body = {"error": {"code": code, "message": message, "details": details or {}, "request_id": request_id}}
    return web.json_response(body, status=status, headers={**(headers or {}), "X-Request-Id": request_id})


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _unstorable(value: Any, where: str = "") -> str | None:
    """Where a value holds text Postgres cannot store (NUL, lone surrogates), if anywhere."""
    if isinstance(value, str):
        if "\x00" in value:
            return where or "<root>"
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return where or "<root>"
    elif isinstance(value, dict):
        for k, v in value.items():
            bad = _unstorable(k, f"{where}.{k}" if where else "<key>") or _unstorable(v, f"{where}.{k}".lstrip("."))
            if bad:
                return bad
    elif isinstance(value, list):
        for i, v in enumerate(value):
            bad = _unstorable(v, f"{where}.{i}".lstrip("."))
            if bad:
                return bad
    return None


def parse_body(model: type[BaseModel], raw: bytes) -> BaseModel:
    """JSON (strictly: no NaN/Infinity, text Postgres can store) validated by the route's model; an empty
    body is `{}`, so a missing body fails on the model's required fields, not as a parse error."""
    try:
        data = json.loads(raw, parse_constant=_reject_constant) if raw.strip() else {}
    except (ValueError, RecursionError):
        raise ApiError(400, "invalid_json", "request body is not JSON") from None
    bad = _unstorable(data)
    if bad:
        raise ApiError(
            422,
            "invalid_request",
            "request body holds text that cannot be stored",
            {"errors": [{"loc": bad, "msg": "NUL or invalid unicode"}]},
        )
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        errors = [{"loc": ".".join(map(str, e["loc"])), "msg": e["msg"]} for e in exc.errors()[:20]]
        raise ApiError(422, "invalid_request", "request body does not match the schema", {"errors": errors}) from None


def _jsonable(result: Any) -> Any:
    if isinstance(result, BaseModel):
        return result.model_dump(mode="json")
    return result


class AdminApi:
    """One service's admin API: its routes behind the shared auth, errors, idempotency and audit."""

    def __init__(
        self,
        *,
        service: str,
        schema: str,
        pool: asyncpg.Pool,
        tokens: Mapping[str, SecretStr | None],
        routes: Sequence[Route],
        repositories: Callable[[asyncpg.Connection], Any] = no_repositories,
    ) -> None:
        usable = {actor: t for actor, t in tokens.items() if t is not None and t.get_secret_value()}
        if not usable:
            raise ValueError(
                f"the {service} admin API needs a bearer token (set GPUAAS_ADMIN_TOKEN); it does not listen without one"
            )
        for actor in usable:
            if not ACTOR_RE.match(actor):
                raise ValueError(f"token actor name {actor!r} is not an identifier")
        self.service, self.schema, self.pool = service, schema, pool
        self._tokens = [(actor, t.get_secret_value().encode()) for actor, t in usable.items()]
        self.routes = list(routes)
        self._repositories = repositories
        self._runner: web.AppRunner | None = None
        self.port: int | None = None

    # --- the aiohttp application ----------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._middleware], client_max_size=MAX_BODY)
        for route in self.routes:
            app.router.add_route(route.method, route.path, self._endpoint(route))
        return app

    async def start(self, host: str, port: int) -> int:
        self._runner = web.AppRunner(self.app(), access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        log.info("admin_api_listening", service=self.service, admin_host=host, admin_port=self.port)
        return self.port

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def _principal(self, request: web.Request) -> str | None:
        given = request.headers.get("Authorization", "")
        token = given[7:].encode() if given.startswith("Bearer ") else b""
        found = None
        for actor, expected in self._tokens:  # every token compared: the time says nothing about which matched
            if hmac.compare_digest(token, expected) and token:
                found = actor
        return found

    @web.middleware
    async def _middleware(self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]):
        given = request.headers.get("X-Request-Id", "")
        request_id = given if REQUEST_ID_RE.match(given) else uuid.uuid4().hex
        request[REQUEST_ID] = request_id
        principal = self._principal(request)
        if principal is None:
            return error_response(
                401,
                "unauthorized",
                "a valid bearer token is required",
                request_id,
                headers={"WWW-Authenticate": "Bearer"},
            )
        request[PRINCIPAL] = principal
        with bound_context(
            request_id=request_id, admin_method=request.method, admin_path=request.path, principal=principal
        ):
            try:
                resp = await handler(request)
            except ApiError as exc:
                log.info("admin_rejected", code=exc.code, status=exc.status)
                return error_response(exc.status, exc.code, exc.message, request_id, exc.details)
            except web.HTTPException as exc:
                # The router's 404/405 and aiohttp's 413, in the same shape as everything else.
                code = {404: "not_found", 405: "method_not_allowed", 413: "body_too_large"}.get(
                    exc.status, "http_error"
                )
                headers = {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else None
                return error_response(exc.status, code, exc.reason, request_id, headers=headers)
            except Exception as exc:  # the client gets the error shape, the log the traceback
                log.error("admin_failed", error=repr(exc), exc_info=True)
                return error_response(500, "internal", "internal error", request_id)
            resp.headers["X-Request-Id"] = request_id
            return resp

    # --- one route --------------------------------------------------------------------------------

    def _inputs(self, route: Route, request: web.Request) -> tuple[dict[str, str], dict[str, str | None]]:
        params = {p: request.match_info[p] for p in route.path_params}
        query = {q: request.query.get(q) for q in route.query}
        bad = _unstorable(params) or _unstorable(query)
        if bad:
            raise ApiError(
                422,
                "invalid_request",
                "a path or query parameter holds text that cannot be stored",
                {"errors": [{"loc": bad, "msg": "NUL or invalid unicode"}]},
            )
        return params, query

    def _actor(self, request: web.Request) -> str:
        named = request.headers.get("X-Actor")
        if named is None:
            return request[PRINCIPAL]
        if not ACTOR_RE.match(named):
            raise ApiError(400, "invalid_actor", "X-Actor must be an identifier (letters, digits, ._:@-)")
        return named

    def _endpoint(self, route: Route) -> Callable[[web.Request], Awaitable[web.Response]]:
        async def endpoint(request: web.Request) -> web.Response:
            if route.mutation:
                return await self._mutate(route, request)
            params, query = self._inputs(route, request)
            async with self.pool.acquire() as conn:
                # Reads are not audited, so X-Actor means nothing here and is not checked.
                call = Call(
                    request, params, query, None, request[PRINCIPAL], request[PRINCIPAL], request[REQUEST_ID], conn
                )
                return self._answer(route, await route.handler(call))

        return endpoint

    def _answer(self, route: Route, result: Any) -> web.Response:
        status = route.statuses[0]
        if isinstance(result, Reply):
            result, status = result.body, result.status
        return web.json_response(_jsonable(result), status=status)

    async def _mutate(self, route: Route, request: web.Request) -> web.Response:
        request_id, principal = request[REQUEST_ID], request[PRINCIPAL]
        key = request.headers.get("Idempotency-Key")
        raw = await request.read()
        digest = hashlib.sha256(b"\0".join([request.method.encode(), request.path.encode(), raw])).hexdigest()
        record = {
            "request_id": request_id,
            "principal": principal,
            "actor": principal,
            "method": request.method,
            "path": request.path,
            "body_sha256": hashlib.sha256(raw).hexdigest(),
            "idempotency_key": key,
        }
        try:
            record["actor"] = actor = self._actor(request)
            if key is None or not KEY_RE.match(key):
                raise ApiError(
                    400,
                    "idempotency_key_required",
                    "mutations need an Idempotency-Key header (1-200 printable ASCII characters)",
                )
            params, query = self._inputs(route, request)
            body = parse_body(route.body, raw) if route.body is not None else None
            return await self._apply(route, request, key, digest, record, params, query, body, actor)
        except ApiError as exc:
            await self._audit_refusal(record, exc.status, exc.code)
            raise
        except Exception:
            await self._audit_refusal(record, 500, "internal")
            raise

    async def _apply(
        self,
        route: Route,
        request: web.Request,
        key: str,
        digest: str,
        record: dict,
        params: dict,
        query: dict,
        body: Any,
        actor: str,
    ) -> web.Response:
        uow = UnitOfWork(
            self.pool, self.schema, self.service, self._repositories, correlation_id=f"admin:{record['request_id']}"
        )
        async with uow:
            # Requests with one key run one at a time: the second waits, then replays or conflicts.
            await uow.conn.execute("SELECT pg_advisory_xact_lock(hashtext('gpuaas-admin-idem:' || $1))", key)
            prior = await uow.conn.fetchrow(
                "SELECT request_hash, method, path, status_code, response FROM admin_idempotency WHERE key = $1", key
            )
            if prior is not None:
                if prior["request_hash"] != digest:
                    raise ApiError(
                        409,
                        "idempotency_conflict",
                        "this Idempotency-Key was used for another request",
                        {"method": prior["method"], "path": prior["path"]},
                    )
                await self._audit(uow.conn, record, prior["status_code"], replayed=True)
                await uow.commit()
                log.info("admin_replayed", actor=actor)
                return web.json_response(
                    json.loads(prior["response"]), status=prior["status_code"], headers={"Idempotent-Replayed": "true"}
                )
            call = Call(request, params, query, body, record["principal"], actor, record["request_id"], uow.conn, uow)
            result = await route.handler(call)
            status = route.statuses[0]
            if isinstance(result, Reply):
                result, status = result.body, result.status
            payload = _jsonable(result)
            await uow.conn.execute(
                "INSERT INTO admin_idempotency (key, method, path, request_hash, status_code, response, request_id, "
                "actor) VALUES ($1, $2, $3, $4, $5, $6::jsonb, $7, $8)",
                key,
                request.method,
                request.path,
                digest,
                status,
                json.dumps(payload),
                record["request_id"],
                actor,
            )
            await self._audit(uow.conn, record, status)
            await uow.commit()
        for hook in call.after_commit:
            hook()
        log.info("admin_mutation", actor=actor, status=status)
        return web.json_response(payload, status=status)

    async def _audit(
        self,
        conn: asyncpg.Connection,
        record: dict,
        status: int,
        *,
        replayed: bool = False,
        error_code: str | None = None,
    ) -> None:
        await conn.execute(
            "INSERT INTO admin_requests (request_id, principal, actor, method, path, body_sha256, idempotency_key, "
            "status, replayed, error_code) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)",
            record["request_id"],
            record["principal"],
            record["actor"],
            record["method"],
            record["path"],
            record["body_sha256"],
            record["idempotency_key"],
            status,
            replayed,
            error_code,
        )

    async def _audit_refusal(self, record: dict, status: int, code: str) -> None:
        """After the rollback, in a transaction of its own: a refusal is audited, its effects are not kept."""
        try:
            async with UnitOfWork(self.pool, self.schema, self.service, no_repositories) as uow:
                await self._audit(uow.conn, record, status, error_code=code)
                await uow.commit()
        except Exception as exc:  # the refusal itself still reaches the client
            log.error("admin_audit_failed", error=repr(exc))


# --- OpenAPI -------------------------------------------------------------------------------------------


def openapi(routes: Sequence[Route], *, title: str, version: str, description: str) -> dict[str, Any]:
    """The OpenAPI 3.1 document of these routes, from their pydantic models (JSON Schema 2020-12)."""
    models: list[tuple[type[BaseModel], str]] = [(Error, "serialization")]
    for r in routes:
        if r.body is not None:
            models.append((r.body, "validation"))
        models.append((r.response, "serialization"))
    keys, defs = models_json_schema(list(dict.fromkeys(models)), ref_template="#/components/schemas/{model}")
    error_ref = keys[(Error, "serialization")]
    paths: dict[str, dict[str, Any]] = {}
    for r in routes:
        parameters: list[dict[str, Any]] = [
            {"name": p, "in": "path", "required": True, "schema": {"type": "string", "minLength": 1}}
            for p in r.path_params
        ]
        parameters += [{"name": q, "in": "query", "required": False, "schema": {"type": "string"}} for q in r.query]
        if r.mutation:
            parameters += [
                {"$ref": "#/components/parameters/IdempotencyKey"},
                {"$ref": "#/components/parameters/XActor"},
            ]
        parameters.append({"$ref": "#/components/parameters/XRequestId"})
        ok_ref = keys[(r.response, "serialization")]
        responses: dict[str, Any] = {
            str(s): {
                "description": "accepted" if s == 202 else "OK",
                "content": {"application/json": {"schema": ok_ref}},
            }
            for s in r.statuses
        }
        for s in r.documented_errors():
            responses[str(s)] = {"description": STATUS_TEXT[s], "content": {"application/json": {"schema": error_ref}}}
        op: dict[str, Any] = {
            "operationId": f"{r.method.lower()}_{re.sub(r'[^a-z0-9]+', '_', r.path.lower()).strip('_')}",
            "summary": r.summary,
            "parameters": parameters,
            "responses": responses,
        }
        if r.body is not None:
            op["requestBody"] = {
                "required": r.body_required,
                "content": {"application/json": {"schema": keys[(r.body, "validation")]}},
            }
        paths.setdefault(r.path, {})[r.method.lower()] = op
    return {
        "openapi": "3.1.0",
        "info": {"title": title, "version": version, "description": description},
        "security": [{"bearer": []}],
        "paths": paths,
        "components": {
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
            "parameters": {
                "IdempotencyKey": {
                    "name": "Idempotency-Key",
                    "in": "header",
                    "required": True,
                    "description": "the same key and request replay the stored answer; another "
                    "request with this key is a 409 idempotency_conflict",
                    "schema": {"type": "string", "pattern": KEY_RE.pattern},
                },
                "XActor": {
                    "name": "X-Actor",
                    "in": "header",
                    "required": False,
                    "description": "who acts (audited); default: the token's actor name",
                    "schema": {"type": "string", "pattern": ACTOR_RE.pattern},
                },
                "XRequestId": {
                    "name": "X-Request-Id",
                    "in": "header",
                    "required": False,
                    "description": "echoed back on every answer; minted when absent or malformed",
                    "schema": {"type": "string"},
                },
            },
            "schemas": defs.get("$defs", {}),
        },
    }


def render_yaml(doc: dict[str, Any]) -> str:
    import yaml

    header = "# Generated from the routes and pydantic models; do not edit (a test fails on drift).\n"
    plain = json.loads(json.dumps(doc))  # no shared objects, so no YAML anchors
    return header + yaml.safe_dump(plain, sort_keys=False, width=120, allow_unicode=True)
