"""The authority's API: three signed requests over HTTPS (`gpuaas_common.identity.signed_request`).

Not the admin HTTP stack of the other services: no bearer token (the caller proves itself with its own bus
identity), no database (nothing here is a resource with idempotency keys: minting twice for a node is refused while its
first user lives; revoking twice revokes nothing the second time), and no OpenAPI page to browse.
A mint for a node that has a live host user is refused (409 node_has_live_user) and mints nothing. A mint names
the deploy command that asked for the host, by its sequence in the MAAS stream; one the bus holds no such command
for is refused (403 no_deploy_command, deploy_command_invalid, deploy_command_mismatch, deploy_command_expired) and
mints nothing, as is a tenant's mint for an allocation that has ended (403 allocation_ended: its users were revoked)
(service_layer/host_users.py).
Every refusal is one JSON error with a stable code, logged once, without the request's signature or JWT.

    POST /v1/host-users  {"node_id", "allocation_id", "ttl_s", "deploy_command_seq"}
        -> 201 {"creds", "user", "expires_at"}
    POST /v1/allocations/{allocation_id}/revoke -> 200 {"revoked": n}  (and the allocation ends: no mint after)
    POST /v1/nodes/{node_id}/end-slice-identity -> 200 {"revoked": n}
    POST /v1/nodes/{node_id}/slice-host-user  {"walk_id", "deploy_command_seq"} -> 201 {"creds", "user", "expires_at"}
"""

from __future__ import annotations

import json
import ssl
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from gpuaas_common.identity.authority import NodeHasLiveUser
from gpuaas_common.identity.signed_request import HEADER, NonceCache, RequestRefused, Trust, verify
from gpuaas_common.logging import get_logger

from ..adapters.deploy_commands import StreamUnreadable
from ..domain.deploy_commands import DeployCommandRefused
from ..domain.grants import GrantRefused, allocation_id, host_user_grant, node_id, slice_host_grant
from ..service_layer.host_users import HostUsers

log = get_logger(__name__)

MAX_BODY = 16 * 1024
Revoked = Callable[[], Awaitable[dict[str, int]]]


def _error(status: int, code: str, message: str) -> web.Response:
    return web.json_response({"error": {"code": code, "message": message}}, status=status)


def _json(request: web.Request) -> Any:
    try:
        return json.loads(request["body"] or b"null")
    except ValueError:
        raise GrantRefused("body", "not JSON") from None


class AuthorityApi:
    def __init__(self, host_users: HostUsers, trust: Trust, revoked: Revoked, *, max_host_ttl_s: float) -> None:
        self.host_users = host_users
        self.trust = trust
        self.revoked = revoked
        self.max_host_ttl_s = max_host_ttl_s
        self.nonces = NonceCache()
        self._runner: web.AppRunner | None = None

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY, middlewares=[self._signed])
        app.router.add_post("/v1/host-users", self._mint)
        app.router.add_post("/v1/allocations/{allocation_id}/revoke", self._revoke)
        app.router.add_post("/v1/nodes/{node_id}/end-slice-identity", self._end_slice)
        app.router.add_post("/v1/nodes/{node_id}/slice-host-user", self._mint_slice_host)
        app.router.add_get("/healthz", self._healthz)
        return app

    @web.middleware
    async def _signed(self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]):
        if request.path == "/healthz":
            return await handler(request)
        try:
            body = await request.read()
        except web.HTTPRequestEntityTooLarge:
            return _error(413, "too_large", f"bodies are {MAX_BODY} bytes at most")
        try:
            claims = verify(
                request.headers.get(HEADER),
                request.method,
                request.path_qs,
                body,
                trust=self.trust,
                revoked=await self.revoked(),
                nonces=self.nonces,
            )
        except RequestRefused as refused:
            log.warning("authority_request_refused", reason=refused.reason, detail=str(refused), path=request.path)
            return _error(refused.status, refused.reason, str(refused))
        request["caller"] = str(claims["name"])
        request["body"] = body
        try:
            return await handler(request)
        except GrantRefused as refused:
            log.warning("authority_request_refused", reason="invalid", field=refused.field, path=request.path)
            return _error(400, "invalid", str(refused))
        except NodeHasLiveUser as refused:
            # A second identity of a host beside the one it runs with: the caller ends the node's users first.
            log.warning(
                "authority_request_refused", reason="node_has_live_user", node_id=refused.node_id, path=request.path
            )
            return _error(409, "node_has_live_user", str(refused))
        except DeployCommandRefused as refused:
            # No deploy on the bus asks for this host user (or its allocation ended): the caller's word mints nothing.
            log.warning("authority_request_refused", reason=refused.code, detail=str(refused), path=request.path)
            return _error(403, refused.code, str(refused))
        except StreamUnreadable as exc:
            # Not a refusal: the gateway's deploy asks again at its next step.
            log.warning(
                "authority_request_failed", reason="deploy_command_unreadable", detail=str(exc), path=request.path
            )
            return _error(503, "deploy_command_unreadable", str(exc))

    async def _mint(self, request: web.Request) -> web.Response:
        grant = host_user_grant(_json(request), max_ttl_s=self.max_host_ttl_s)
        minted = await self.host_users.mint(grant, request["caller"])
        return web.json_response(
            {"creds": minted.creds, "user": minted.user, "expires_at": minted.expires_at}, status=201
        )

    async def _revoke(self, request: web.Request) -> web.Response:
        allocation = allocation_id(request.match_info["allocation_id"])
        return web.json_response({"revoked": await self.host_users.revoke_allocation(allocation, request["caller"])})

    async def _end_slice(self, request: web.Request) -> web.Response:
        node = node_id(request.match_info["node_id"])
        return web.json_response({"revoked": await self.host_users.end_slice_identity(node, request["caller"])})

    async def _mint_slice_host(self, request: web.Request) -> web.Response:
        grant = slice_host_grant(request.match_info["node_id"], _json(request))
        minted = await self.host_users.mint_slice_host(grant, request["caller"])
        return web.json_response(
            {"creds": minted.creds, "user": minted.user, "expires_at": minted.expires_at}, status=201
        )

    async def _healthz(self, _request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    async def start(self, host: str, port: int, tls: ssl.SSLContext) -> int:
        self._runner = web.AppRunner(self.app(), access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port, ssl_context=tls)
        await site.start()
        server = site._server
        assert server is not None and server.sockets  # type: ignore[attr-defined]
        return int(server.sockets[0].getsockname()[1])  # type: ignore[attr-defined]

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
