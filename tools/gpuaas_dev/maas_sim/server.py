"""Starting the simulator in-process (tests, dev stack) or as a blocking CLI server."""

from __future__ import annotations

import asyncio
import ssl
from pathlib import Path

import structlog
from aiohttp import web

from .app import STATE_KEY, create_app
from .config import SimConfig
from .state import SimState

log = structlog.get_logger("gpuaas_dev.maas_sim")


async def start(
    config: SimConfig, host: str = "127.0.0.1", port: int = 0, ssl_context: ssl.SSLContext | None = None
) -> tuple[web.AppRunner, int]:
    """Serve on host:port (0 picks a free port), HTTPS with `ssl_context`; returns the runner (call `cleanup()`)
    and the port."""
    app = create_app(config)
    # A short shutdown timeout: handlers held open by a lost-response fault are released on
    # shutdown anyway, and nothing else is long-running.
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=2.0)
    await runner.setup()
    site = web.TCPSite(runner, host, port, ssl_context=ssl_context)
    await site.start()
    server = site._server  # aiohttp exposes the bound socket only here
    actual_port = server.sockets[0].getsockname()[1] if server is not None else port
    log.info(
        "maas_sim_started",
        host=host,
        port=actual_port,
        tls=ssl_context is not None,
        machines=len(app[STATE_KEY].machines),
    )
    return runner, actual_port


def tls_context(cert: str | Path, key: str | Path) -> ssl.SSLContext:
    """The listener's side of HTTPS: `cert` (a chain from the dev stack's CA, say) and its key; TLS 1.2 or newer,
    as `gpuaas_common.identity.tls.server_context`."""
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(str(cert), str(key))
    return ctx


def state_of(runner: web.AppRunner) -> SimState:
    """The live simulator state behind a runner returned by `start`, for in-process tests."""
    return runner.app[STATE_KEY]


def run(
    config: SimConfig, host: str = "127.0.0.1", port: int = 5240, ssl_context: ssl.SSLContext | None = None
) -> None:
    """Serve until interrupted (HTTPS with `ssl_context`)."""

    async def main() -> None:
        runner, actual_port = await start(config, host, port, ssl_context)
        scheme = "https" if ssl_context is not None else "http"
        print(f"MAAS simulator at {scheme}://{host}:{actual_port}/MAAS/", flush=True)
        try:
            await asyncio.Event().wait()
        finally:
            await runner.cleanup()

    try:
        asyncio.run(main())
    except KeyboardInterrupt:
        pass
