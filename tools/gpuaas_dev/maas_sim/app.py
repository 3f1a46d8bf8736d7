"""aiohttp application: MAAS API 2.0 under /MAAS/api/2.0/ and the simulator's own /_sim/ controls."""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
from typing import Any

import structlog
from aiohttp import web

from . import control
from .config import SimConfig
from .describe import compute_api_hash, describe_document
from .errors import BadRequest, MaasSimError, NotFound
from .faults import Fault
from .handlers import ROUTES, Call, Created, NoContent, Operation, Route
from .state import API_ROOT, SimState
from .wire import error_response, json_response, read_params, text_response

log = structlog.get_logger("gpuaas_dev.maas_sim")

STATE_KEY: web.AppKey[SimState] = web.AppKey("maas_sim_state", SimState)
API_HASH_KEY: web.AppKey[str] = web.AppKey("maas_sim_api_hash", str)

_CONFLICT_HTML = (
    "<html><head><title>409 Conflict</title></head><body><h1>Conflict</h1>"
    "<p>could not serialize access due to concurrent update</p></body></html>"
)


def _match(path: str) -> tuple[Route, dict[str, str]] | None:
    tail = path[len(API_ROOT) :]
    for route in ROUTES:
        found = route.pattern.match(tail)
        if found:
            return route, found.groupdict()
    return None


async def _describe(request: web.Request) -> web.StreamResponse:
    base_url = f"{request.scheme}://{request.host}"
    doc = describe_document([r.spec() for r in ROUTES], API_ROOT, base_url, request.app[API_HASH_KEY])
    # python-libmaas insists on exactly `application/json` (no charset) here.
    return web.Response(body=json.dumps(doc).encode("utf-8"), headers={"Content-Type": "application/json"})


async def _hold_or_drop(request: web.Request, state: SimState, fault: Fault) -> web.StreamResponse:
    """Never answer: the change is committed, the client must find out by reading the machine."""
    log.info("maas_api_response_lost", method=request.method, path=request.path, mode=fault.mode)
    if fault.mode == "hold":
        try:
            await asyncio.wait_for(state.shutting_down.wait(), timeout=fault.hold_seconds)
        except TimeoutError:
            pass
    transport = request.transport
    if transport is not None:
        transport.abort()
    raise _Dropped()


class _Dropped(Exception):
    """The connection was deliberately dropped; there is nothing to send."""


def _fault_response(fault: Fault) -> web.Response | None:
    if fault.kind == "conflict":
        return text_response(
            _CONFLICT_HTML, 409, {"Retry-After": _seconds(fault.retry_after, 5)}, content_type="text/html"
        )
    if fault.kind == "unavailable":
        return text_response(
            "Unable to connect to any rack controller; no connections available.",
            503,
            {"Retry-After": _seconds(fault.retry_after, 10)},
        )
    if fault.kind == "gateway_timeout":
        return text_response("Timed out waiting for a response from the rack controller.", 504)
    if fault.kind == "server_error":
        return text_response("Internal server error.", 500)
    return None


def _seconds(value: float | None, default: float) -> str:
    seconds = default if value is None else value
    return str(int(seconds)) if float(seconds).is_integer() else str(seconds)


def _result_response(result: object) -> web.Response:
    if isinstance(result, Created):
        return json_response(result.data, status=201)
    if isinstance(result, NoContent):
        return web.Response(status=204)
    if isinstance(result, str):
        return text_response(result, 200)
    return json_response(result)


_TOKEN_LINE = re.compile(rb"(GPUAAS_ENROLMENT_TOKEN=)([0-9a-f]{64})")


def alter_user_data(machine: Any) -> None:
    """What the machine will read is not what the deploy sent: its enrolment token is another one."""
    deploy = machine.last_deploy or {}
    sent = deploy.get("user_data") or b""
    deploy["user_data"] = _TOKEN_LINE.sub(lambda m: m.group(1) + hashlib.sha256(m.group(2)).hexdigest().encode(), sent)


async def _run_operation(request: web.Request, state: SimState, operation: Operation, call: Call) -> web.StreamResponse:
    system_id = call.path.get("system_id") or call.params.get("system_id")
    state.record_call(operation.name, system_id)
    faults = state.faults.draw(operation.name, system_id)
    before = [f for f in faults if not f.commit]
    after = [f for f in faults if f.commit]

    for fault in before:
        if fault.latency:
            await asyncio.sleep(fault.latency)
        response = _fault_response(fault)
        if response is not None:
            return response

    failing = {("deploy", "failed_deployment"): "deploying", ("release", "failed_disk_erasing"): "disk_erasing"}
    for fault in after:
        phase = failing.get((operation.name, fault.kind))
        if phase is not None:
            call.machine.inject_failure(phase, fault.status_message or "")
    result = operation.fn(call)
    if operation.name == "deploy" and any(f.kind == "altered_user_data" for f in after):
        alter_user_data(call.machine)

    for fault in after:
        if fault.latency:
            await asyncio.sleep(fault.latency)
        if fault.kind == "lost_after_commit":
            return await _hold_or_drop(request, state, fault)
        response = _fault_response(fault)
        if response is not None:
            return response
    return _result_response(result)


async def _maas_api(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE_KEY]
    path = request.path
    op: str | None = None
    name: str | None = None
    try:
        found = _match(path)
        if found is None:
            raise NotFound(f"Unknown API endpoint: {path}.")
        route, path_params = found
        params = await read_params(request)
        op = params.get("op")
        if not route.anon:
            state.verifier.verify(request.headers.get("Authorization"), dict(request.query))
        operation = route.find(request.method, op)
        if operation is None:
            raise BadRequest(f"Unrecognised signature: method={request.method} op={op}")
        name = operation.name
        response = await _run_operation(request, state, operation, Call(state, params, path_params))
    except MaasSimError as error:
        response = error_response(error)
    if name is not None:
        state.record_response(name, response.status)
    log.info("maas_api", method=request.method, path=path, op=op, status=response.status)
    return response


async def _add_api_hash(request: web.Request, response: web.StreamResponse) -> None:
    response.headers["X-MAAS-API-Hash"] = request.app[API_HASH_KEY]


@web.middleware
async def _swallow_dropped(request: web.Request, handler):  # type: ignore[no-untyped-def]
    try:
        return await handler(request)
    except _Dropped:
        # Returning an empty response to an aborted transport is discarded by aiohttp.
        return web.Response(status=499)


async def _on_shutdown(app: web.Application) -> None:
    app[STATE_KEY].shutting_down.set()


def create_app(config: SimConfig) -> web.Application:
    state = SimState(config)
    # Boot resource chunks are 4 MiB (python-libmaas) and a multipart `content` is a whole image.
    app = web.Application(middlewares=[_swallow_dropped], client_max_size=1 << 32)
    app[STATE_KEY] = state
    app[API_HASH_KEY] = compute_api_hash([r.spec() for r in ROUTES], API_ROOT)
    app.router.add_get(API_ROOT + "describe/", _describe)
    app.router.add_route("*", API_ROOT + "{tail:.*}", _maas_api)
    app.router.add_route("*", "/MAAS/api/2.0", _maas_api)
    control.add_routes(app, STATE_KEY)
    app.on_response_prepare.append(_add_api_hash)
    app.on_shutdown.append(_on_shutdown)
    return app
