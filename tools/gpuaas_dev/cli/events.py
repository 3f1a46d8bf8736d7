"""`gpuaas events tail`: follow messages on the bus as they are published."""

import asyncio
import json
from typing import Annotated

import typer

from .bus import ALLOCATION_EVENTS, bus_identity, connect, describe_event, resolve_nats_url
from .common import DEFAULT_RUN_DIR, CredsOpt, NatsUrlOpt, RunDirOpt, err

events_app = typer.Typer(no_args_is_help=True, help="Watch the event bus.")


@events_app.command("tail")
def events_tail(
    subject: Annotated[str, typer.Option("--subject", help="NATS subject (wildcards allowed).")] = ALLOCATION_EVENTS,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object per line on stdout.")] = False,
    count: Annotated[int, typer.Option("--count", help="Stop after this many messages (0: never).")] = 0,
    nats_url: NatsUrlOpt = None,
    creds: CredsOpt = None,
    run_dir: RunDirOpt = DEFAULT_RUN_DIR,
) -> None:
    """Follow messages as they are published (new ones only) until Ctrl-C."""
    url = resolve_nats_url(nats_url, run_dir)
    identity = bus_identity(url, creds, run_dir, "ops")

    async def run() -> None:
        queue: asyncio.Queue = asyncio.Queue()

        async def on_closed() -> None:
            await queue.put(None)  # the stack went away: stop instead of waiting forever

        nc = await connect(identity, closed_cb=on_closed)

        async def on_msg(msg) -> None:
            await queue.put(msg)

        await nc.subscribe(subject, cb=on_msg)
        await nc.flush()
        err.print(f"[dim]following {subject} on {url} (Ctrl-C to stop)[/]")
        seen = 0
        try:
            while count == 0 or seen < count:
                msg = await queue.get()
                if msg is None:
                    err.print("[yellow]connection to NATS closed[/]")
                    return
                seen += 1
                try:
                    data = json.loads(msg.data)
                except ValueError:
                    data = {"raw": msg.data.decode("utf-8", "replace")}
                if as_json:
                    typer.echo(json.dumps({"subject": msg.subject, **data}, default=str), nl=True)
                    continue
                payload = data.get("payload", {}) if isinstance(data, dict) else {}
                kind = str(data.get("type", "?"))
                summary = (
                    describe_event(kind.split(".", 1)[1], payload)
                    if kind.startswith("allocation.")
                    else json.dumps(payload, default=str)[:200]
                )
                err.print(
                    f"[dim]{data.get('occurred_at', '')}[/] [cyan]{kind}[/] "
                    f"{payload.get('allocation_id', '')} {summary}"
                )
        finally:
            if not nc.is_closed:
                await nc.drain()

    try:
        asyncio.run(run())
    except KeyboardInterrupt:
        pass
