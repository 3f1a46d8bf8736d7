"""The slice terminal's websocket: `GET /v1/allocations/{allocation_id}/terminal`, upgraded.

The caller is the portal acting for a person signed in to it: its bearer is a tenant assertion the portal signed
(domain/portal_assertion.py: tenant, person, expiry, HMAC under GPUAAS_TERMINAL_ASSERTION_SECRET), and it opens
only that tenant's consoles; the audit row names the person. A refusal (no, an unsigned or an expired assertion,
another tenant's allocation, one not active, a baremetal one, a console already open on it, the tenant at its
cap) is answered before the upgrade with the API's error shape, and nothing is stored or sent to any host.

On the socket: binary frames are the terminal's bytes both ways; text frames from the server are JSON notices,
`{"type": "session_ready", "session_id": …}` once the host's agent relays, `{"type": "input_refused", …}` for a
frame past the input window (nothing of it kept: the guest has not read what came before), and
`{"type": "closed", "reason": …}` before the server closes. A raw VNC or SPICE console is never offered: the
guest has none (domain_xml).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid

from aiohttp import WSMsgType, web
from pydantic import SecretStr

from gpuaas_common.admin_http.errors import error_response
from gpuaas_common.logging import bound_context, get_logger

from ..domain.portal_assertion import AssertionRefused, TenantAssertion, verify
from ..service_layer.terminal import Refused, Session, TerminalHub

log = get_logger(__name__)

# A tenant typing: far below a chunk; a paste larger than this arrives in several frames.
MAX_FRAME = 64 * 1024


class TerminalApi:
    def __init__(self, hub: TerminalHub, assertion_secret: SecretStr, *, open_timeout_s: float) -> None:
        if not assertion_secret.get_secret_value():
            raise ValueError("the terminal endpoint needs the portal's key (GPUAAS_TERMINAL_ASSERTION_SECRET)")
        self.hub = hub
        self._secret = assertion_secret.get_secret_value().encode()
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

    def _asserted(self, request: web.Request) -> TenantAssertion:
        given = request.headers.get("Authorization", "")
        if not given.startswith("Bearer "):
            raise AssertionRefused("a portal tenant assertion is required (Authorization: Bearer)")
        return verify(self._secret, given[7:], time.time())

    async def terminal(self, request: web.Request) -> web.StreamResponse:
        request_id = uuid.uuid4().hex
        try:
            asserted = self._asserted(request)
        except AssertionRefused as exc:
            log.info("terminal_unauthorized", request_id=request_id, reason=str(exc))
            return error_response(401, "unauthorized", str(exc), request_id, headers={"WWW-Authenticate": "Bearer"})
        # The tenant is the assertion's, never a header's: a portal identity opens only its own tenant's consoles.
        tenant, actor = asserted.tenant_id, f"user:{asserted.user_id}"
        try:
            allocation_id = uuid.UUID(request.match_info["allocation_id"])
        except ValueError:
            return error_response(404, "unknown_allocation", "not an allocation id", request_id)
        cols = _size(request.query.get("cols"), 80)
        rows = _size(request.query.get("rows"), 24)
        with bound_context(request_id=request_id, allocation_id=str(allocation_id), tenant_id=tenant):
            try:
                session = await self.hub.open(allocation_id, tenant, actor, cols=cols, rows=rows)
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
                    kept = self.hub.type(session, msg.data)
                elif msg.type == WSMsgType.TEXT:
                    kept = self.hub.type(session, msg.data.encode())
                else:
                    kept = True
                if not kept:
                    notice = {
                        "type": "input_refused",
                        "reason": "input_window",
                        "detail": f"the guest has not read the last {self.hub.limits.input_window} bytes: "
                        "this frame was dropped, send it again later",
                    }
                    await ws.send_str(json.dumps(notice))
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
            # send_bytes returns once the transport is under its high-water mark: a tenant that stops reading
            # stops it here, the bytes stay counted as queued, and the host's ack waits (service_layer/terminal).
            await ws.send_bytes(chunk)
            session.written(len(chunk))
        while not session.output.empty():
            rest = session.output.get_nowait()
            if rest:
                await ws.send_bytes(rest)
                session.written(len(rest))
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
