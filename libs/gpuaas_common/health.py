"""Readiness, liveness and Prometheus metrics over HTTP, one small server per process."""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from .admin_http.errors import error_response
from .metrics import READINGS


@web.middleware
async def _json_errors(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]):
    # Unknown paths and wrong methods answer in the admin APIs' error shape, not aiohttp's plain text.
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status, "http_error")
        headers = {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else None
        return error_response(exc.status, code, exc.reason, uuid.uuid4().hex, headers=headers)


class HealthServer:
    def __init__(self, service: str, host: str = "127.0.0.1", port: int = 0) -> None:
        self.service = service
        self.host = host
        self.port = port
        self.ready = False
        self.checks: dict[str, Callable[[], bool]] = {}
        self._runner: web.AppRunner | None = None

    async def _healthz(self, _: web.Request) -> web.Response:
        return web.json_response({"service": self.service, "alive": True})

    async def _readyz(self, _: web.Request) -> web.Response:
        checks = {name: bool(fn()) for name, fn in self.checks.items()}
        ok = self.ready and all(checks.values())
        return web.json_response({"service": self.service, "ready": ok, "checks": checks}, status=200 if ok else 503)

    async def _metrics(self, _: web.Request) -> web.Response:
        # The readings (counts in the service's tables, its durables' lag) are read now, then served with the rest.
        await READINGS.refresh()
        return web.Response(body=generate_latest(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def start(self) -> int:
        app = web.Application(middlewares=[_json_errors])
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/readyz", self._readyz)
        app.router.add_get("/metrics", self._metrics)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return self.port

    async def stop(self) -> None:
        if self._runner:
            await self._runner.cleanup()
