"""The console's server-sent events: one `changed` event per commit of the read models (its data the stream
that changed, or `admin` for a console action), on which a page fetches its live part again (static/console.js).
A comment line every KEEPALIVE_S keeps proxies from closing a quiet stream. The streams end when the API stops,
so a stop does not wait on open pages."""

from __future__ import annotations

import asyncio

from aiohttp import web

from ...adapters.changes import Changes

KEEPALIVE_S = 15.0
CLOSING = web.AppKey("console_closing", asyncio.Event)


def install(app: web.Application, changes: Changes, path: str) -> None:
    app[CLOSING] = asyncio.Event()

    async def closing(app: web.Application) -> None:
        app[CLOSING].set()

    app.on_shutdown.append(closing)

    async def events(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-store", "X-Accel-Buffering": "no"}
        )
        await resp.prepare(request)
        stop = asyncio.ensure_future(request.app[CLOSING].wait())
        try:
            with changes.subscribe() as queue:
                await resp.write(b"retry: 2000\n: listening\n\n")
                while not stop.done():
                    got = asyncio.ensure_future(queue.get())
                    done, _ = await asyncio.wait({got, stop}, timeout=KEEPALIVE_S, return_when=asyncio.FIRST_COMPLETED)
                    if got in done:
                        await resp.write(f"event: changed\ndata: {got.result()}\n\n".encode())
                        continue
                    got.cancel()
                    if not stop.done():
                        await resp.write(b": keepalive\n\n")
        except ConnectionError:
            pass  # the page went away
        finally:
            stop.cancel()
        return resp

    app.router.add_get(path, events)
