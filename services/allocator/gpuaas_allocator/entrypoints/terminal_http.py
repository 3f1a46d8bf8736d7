"""The slice terminal's websocket: `GET /v1/allocations/{allocation_id}/terminal`, upgraded.

The caller is the portal acting for a tenant, as on the bus (allocation.requested names its tenant): its bearer
token (GPUAAS_PORTAL_TOKEN) proves it is the portal, `X-Tenant-Id` names the tenant it authenticated. A refusal
(no or a wrong token, another tenant's allocation, one not active, a baremetal one) is answered before the
upgrade with the API's error shape, and nothing is stored or sent to any host.

On the socket: binary frames are the terminal's bytes both ways; text frames from the server are JSON notices,
`{"type": "session_ready", "session_id": …}` once the host's agent relays, and `{"type": "closed", "reason": …}`
before the server closes. A raw VNC or SPICE console is never offered: the guest has none (domain_xml).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import re
import uuid

from aiohttp import WSMsgType, web
from pydantic import SecretStr

from gpuaas_common.admin_http.errors import error_response
from gpuaas_common.logging import bound_context, get_logger

from ..service_layer.terminal import Refused, Session, TerminalHub

log = get_logger(__name__)

TENANT_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")
# A tenant typing: far below a chunk; a paste larger than this arrives in several frames.
MAX_FRAME = 64 * 1024


class TerminalApi:
    def __init__(self, hub: TerminalHub, portal_token: SecretStr, *, open_timeout_s: float) -> None:
        if not portal_token.get_secret_value():
            raise ValueError("the terminal endpoint needs a portal token (GPUAAS_PORTAL_TOKEN)")
        self.hub = hub
        self._token = portal_token.get_secret_value().encode()
        self.open_timeout_s = open_timeout_s
        self._runner: web.AppRunner | None = None

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/v1/allocations/{allocation_id}/terminal", self.terminal)
        return app

    async def start(self, host: str, port: int) -> int:
        self._runner = web.AppRunner(self.app(), access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        await site.start()
        bound = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        log.info("terminal_api_listening", terminal_host=host, terminal_port=bound)
        return int(bound)

    async def stop(self) -> None:
        for session in list(self.hub.sessions.values()):
            await self.hub.close(session, "client_closed", "the control plane stopped")
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def _authenticated(self, request: web.Request) -> bool:
        given = request.headers.get("Authorization", "")
        token = given[7:].encode() if given.startswith("Bearer ") else b""
        return bool(token) and hmac.compare_digest(token, self._token)

    async def terminal(self, request: web.Request) -> web.StreamResponse:
        request_id = uuid.uuid4().hex
        if not self._authenticated(request):
            return error_response(
                401,
                "unauthorized",
                "the portal's bearer token is required",
                request_id,
                headers={"WWW-Authenticate": "Bearer"},
            )
        tenant = request.headers.get("X-Tenant-Id", "")
        if not TENANT_RE.match(tenant):
            return error_response(400, "invalid_tenant", "X-Tenant-Id must name the tenant (an identifier)", request_id)
        try:
            allocation_id = uuid.UUID(request.match_info["allocation_id"])
        except ValueError:
            return error_response(404, "unknown_allocation", "not an allocation id", request_id)
        cols = _size(request.query.get("cols"), 80)
        rows = _size(request.query.get("rows"), 24)
        with bound_context(request_id=request_id, allocation_id=str(allocation_id), tenant_id=tenant):
            try:
                session = await self.hub.open(allocation_id, tenant, f"portal:{tenant}", cols=cols, rows=rows)
            except Refused as exc:
                r = exc.refusal
                return error_response(r.status, r.code, r.reason, request_id)
            ws = web.WebSocketResponse(max_msg_size=MAX_FRAME, heartbeat=30.0)
            try:
                await ws.prepare(request)
                await self._relay(ws, session)
            finally:
                await self.hub.close(session, session.end_reason or "client_closed")
                if not ws.closed:
                    await ws.close()
            return ws

    async def _relay(self, ws: web.WebSocketResponse, session: Session) -> None:
        try:
            await asyncio.wait_for(session.agent_seen.wait(), self.open_timeout_s)
        except TimeoutError:
            await self.hub.close(
                session, "agent_gone", f"the host did not start relaying in {self.open_timeout_s:.0f}s"
            )
        if not session.closed:
            await ws.send_str(json.dumps({"type": "session_ready", "session_id": str(session.session_id)}))
        to_client = asyncio.create_task(self._to_client(ws, session))
        try:
            async for msg in ws:
                if msg.type == WSMsgType.BINARY:
                    self.hub.type(session, msg.data)
                elif msg.type == WSMsgType.TEXT:
                    self.hub.type(session, msg.data.encode())
                if session.closed:
                    break
            if not session.closed:
                await self.hub.close(session, "client_closed")
        finally:
            # The guest's last bytes and the closing notice go out before the socket closes.
            with contextlib.suppress(ConnectionError):
                await to_client

    async def _to_client(self, ws: web.WebSocketResponse, session: Session) -> None:
        while True:
            chunk = await session.output.get()
            if chunk is None:
                break
            await ws.send_bytes(chunk)
        while not session.output.empty():
            rest = session.output.get_nowait()
            if rest:
                await ws.send_bytes(rest)
        if not ws.closed:
            notice = {"type": "closed", "reason": session.end_reason, "detail": session.end_detail}
            await ws.send_str(json.dumps(notice))
            await ws.close()


def _size(given: str | None, default: int) -> int:
    try:
        value = int(given) if given else default
    except ValueError:
        return default
    return min(max(value, 10), 500)
