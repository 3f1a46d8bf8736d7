"""`gpuaas events tail`: follow messages on the bus as they are published."""

import asyncio
import json
import shutil
import sys
from typing import Annotated, Any

import typer
from rich.markup import escape
from rich.text import Text

from .bus import ALLOCATION_EVENTS, bus_identity, connect, describe_event, resolve_nats_url
from .common import DEFAULT_RUN_DIR, CredsOpt, NatsUrlOpt, RunDirOpt, err, out

events_app = typer.Typer(no_args_is_help=True, help="Watch the event bus.")


def event_line(subject: str, data: Any) -> str:
    """One event as one line of rich markup: time, type, allocation (if any), a summary."""
    if not isinstance(data, dict):
        data = {"raw": data}
    payload = data.get("payload") if isinstance(data.get("payload"), dict) else {}
    kind = str(data.get("type", subject))
    at = str(data.get("occurred_at", ""))[11:23]  # HH:MM:SS.mmm of an ISO timestamp
    if kind.startswith("allocation."):
        summary = describe_event(kind.split(".", 1)[1], payload)
        kind = kind.split(".", 1)[1]
    else:
        summary = escape(json.dumps(payload or data, default=str, separators=(",", ":")))
    alloc = f" {payload['allocation_id']}" if payload.get("allocation_id") else ""
    return f"[dim]{at}[/] [cyan]{kind}[/]{alloc} {summary}".replace("\n", " ")


def print_line(markup: str) -> None:
    """Print one line on stdout; on a terminal cut to its width, so an event never wraps onto a second line."""
    text = Text.from_markup(markup)
    if sys.stdout.isatty():
        text.truncate(shutil.get_terminal_size((80, 24)).columns, overflow="ellipsis")
    out.print(text)


@events_app.command("tail")
def events_tail(
    subject: Annotated[str, typer.Option("--subject", help="NATS subject (wildcards allowed).")] = ALLOCATION_EVENTS,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object per line on stdout.")] = False,
    count: Annotated[int, typer.Option("--count", help="Stop after this many messages (0: never).")] = 0,
    nats_url: NatsUrlOpt = None,
    creds: CredsOpt = None,
    run_dir: RunDirOpt = DEFAULT_RUN_DIR,
) -> None:
    """Follow messages as they are published (new ones only) until Ctrl-C: one line per event on stdout.

    Example: gpuaas events tail --subject 'gpuaas.dlq.>' --json"""
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
                if not isinstance(data, dict):
                    data = {"raw": data}
                if as_json:
                    typer.echo(json.dumps({"subject": msg.subject, **data}, default=str), nl=True)
                    continue
                print_line(event_line(msg.subject, data))
        finally:
            if not nc.is_closed:
                await nc.drain()

    try:
        asyncio.run(run())
    except KeyboardInterrupt:
        pass
