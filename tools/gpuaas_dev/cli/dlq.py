"""`gpuaas dlq list|show`: the dead letters kept in the DLQ stream, each with why its consumer gave up on it.

Reading a stored message back is a JetStream API call that only the admin identity may make (ops may follow
`gpuaas.dlq.>` live with `events tail`, not read the stream's past). On the dev stack this is the operator's own
tool on their own stack, so it acts as the stack's admin; elsewhere pass admin creds with --creds. It only
reads: nothing is acked, removed or redelivered."""

from __future__ import annotations

import asyncio
import base64
import json
import re
from typing import Annotated, Any, Optional

import typer

from .bus import bus_identity, connect, resolve_nats_url
from .common import (
    DEFAULT_RUN_DIR,
    EXIT_FAILED,
    EXIT_USAGE,
    CredsOpt,
    NatsUrlOpt,
    RunDirOpt,
    err,
    fail,
    not_found,
    timed_out,
)
from .output import Column, OutputOpt, age_of, emit

dlq_app = typer.Typer(no_args_is_help=True, help="Dead letters: what consumers gave up on, and why (read-only).")

STREAM = "DLQ"
WHAT = "JetStream"
TimeoutOpt = Annotated[float, typer.Option("--timeout", min=0.1, help="Seconds to wait for each JetStream answer.")]
LIST_COLUMNS: list[Column] = [
    "seq",
    age_of("occurred_at"),
    "consumer",
    ("REASON", lambda r: r.get("reason_code")),
    ("SUBJECT", lambda r: r.get("subject")),
    ("TYPE", lambda r: r.get("type")),
]
LIST_WIDE: list[Column] = ["num_delivered", ("ORIGIN", lambda r: f"{r.get('stream')}:{r.get('stream_seq')}"), "reason"]
SHOW_FIELDS: list[Column] = [
    "seq",
    "occurred_at",
    age_of("occurred_at"),
    "consumer",
    "reason_code",
    "reason",
    "subject",
    "type",
    ("origin", lambda r: f"{r.get('stream')}:{r.get('stream_seq')}"),
    "num_delivered",
]


def letter(seq: int, data: bytes) -> dict[str, Any]:
    """One stored dead letter as the CLI shows it: the DeadLetter's fields, its envelope's time and id, the
    original message's type, and the original body (JSON when it is JSON, else text, else base64)."""
    try:
        env = json.loads(data)
    except ValueError:
        env = {}
    p = env.get("payload") if isinstance(env, dict) and isinstance(env.get("payload"), dict) else {}
    body: Any = None
    if p.get("body_text") is not None:
        try:
            body = json.loads(p["body_text"])
        except ValueError:
            body = p["body_text"]
    elif p.get("body_base64"):
        body = {"base64": p["body_base64"], "bytes": len(base64.b64decode(p["body_base64"]))}
    kind = body.get("type") if isinstance(body, dict) and isinstance(body.get("type"), str) else None
    return {
        "seq": seq,
        "event_id": env.get("event_id") if isinstance(env, dict) else None,
        "occurred_at": env.get("occurred_at") if isinstance(env, dict) else None,
        "consumer": p.get("consumer"),
        "stream": p.get("stream"),
        "stream_seq": p.get("stream_seq"),
        "subject": p.get("subject"),
        "type": kind,
        "num_delivered": p.get("num_delivered"),
        "reason_code": p.get("reason_code"),
        "reason": p.get("reason"),
        "headers": p.get("headers") or {},
        "original": body,
    }


async def _jetstream(nats_url: Optional[str], creds: Any, run_dir: Any, timeout: float) -> tuple[Any, Any]:
    url = resolve_nats_url(nats_url, run_dir)
    nc = await connect(bus_identity(url, creds, run_dir, "admin"))
    return nc, nc.jetstream(timeout=timeout)


async def _guarded(coro: Any, timeout: float) -> Any:
    """JetStream's answers mapped onto the exit-code table."""
    import nats.errors
    import nats.js.errors

    try:
        return await coro
    except nats.js.errors.NotFoundError:
        raise fail(
            f"[red]no {STREAM} stream[/] (streams are provisioned by the admin identity, e.g. `gpuaas dev up`)",
            EXIT_FAILED,
        ) from None
    except nats.errors.TimeoutError:
        raise timed_out(WHAT, timeout) from None
    except nats.errors.NoRespondersError:
        raise fail("[red]JetStream is not enabled on this NATS server[/]", EXIT_FAILED) from None
    except nats.js.errors.APIError as exc:
        raise fail(f"[red]refused by JetStream[/]: {exc.description or exc}", EXIT_FAILED) from None


async def _read(js: Any, seq: int, subject: Optional[str] = None, nxt: bool = False) -> Optional[Any]:
    import nats.js.errors

    try:
        return await js.get_msg(STREAM, seq=seq, subject=subject, next=nxt)
    except nats.js.errors.NotFoundError:
        return None  # removed by the stream's limits, or no more for this subject


async def _list(js: Any, consumer: Optional[str], limit: int) -> list[dict[str, Any]]:
    info = await js.stream_info(STREAM)
    first, last = info.state.first_seq, info.state.last_seq
    found: list[dict[str, Any]] = []
    if not info.state.messages or not last or first > last:
        # Empty: a new stream says 0 and 0, a purged one first = last + 1; sequence 0 is not one to ask for.
        return found
    if consumer:
        # The server finds each next one of the subject; a subject holds at most a bounded number of letters.
        seq = first
        while seq and seq <= last:
            msg = await _read(js, seq, f"gpuaas.dlq.{consumer}", nxt=True)
            if msg is None:
                break
            found.append(letter(msg.seq, msg.data))
            seq = msg.seq + 1
        return found[-limit:][::-1]
    for seq in range(last, first - 1, -1):
        if len(found) >= limit:
            break
        msg = await _read(js, seq)
        if msg is not None:
            found.append(letter(msg.seq, msg.data))
    return found


@dlq_app.command("list")
def dlq_list(
    consumer: Annotated[
        Optional[str], typer.Option("--consumer", help="Only the letters this durable gave up on.")
    ] = None,
    limit: Annotated[int, typer.Option("--limit", min=1, max=10_000, help="The newest this many letters.")] = 50,
    output: OutputOpt = "table",
    timeout: TimeoutOpt = 5.0,
    nats_url: NatsUrlOpt = None,
    creds: CredsOpt = None,
    run_dir: RunDirOpt = DEFAULT_RUN_DIR,
) -> None:
    """The newest dead letters first: sequence, age, the consumer that gave up, the reason code, the original
    subject and type (-o wide: deliveries, where it came from, the reason's text).

    Example: gpuaas dlq list --consumer allocator-task-results -o wide"""
    if consumer is not None and not consumer.replace("-", "").replace("_", "").isalnum():
        raise fail(f"[red]invalid consumer {consumer!r}[/]: a durable name (letters, digits, - and _)", EXIT_USAGE)

    async def run() -> list[dict[str, Any]]:
        nc, js = await _jetstream(nats_url, creds, run_dir, timeout)
        try:
            return await _guarded(_list(js, consumer, limit), timeout)
        finally:
            await nc.close()

    rows = asyncio.run(run())
    if not rows and getattr(output, "value", output) in ("table", "wide"):
        # As kubectl says "No resources found": on stderr, so the table on stdout stays empty.
        err.print(f"no dead letters{f' of {consumer}' if consumer else ''} in the {STREAM} stream")
        return
    emit({"dead_letters": rows}, output, rows=rows, columns=LIST_COLUMNS, wide=LIST_WIDE)


@dlq_app.command("show")
def dlq_show(
    seq: Annotated[str, typer.Argument(help="The letter's sequence number in the DLQ stream (SEQ of `dlq list`).")],
    output: OutputOpt = "table",
    timeout: TimeoutOpt = 5.0,
    nats_url: NatsUrlOpt = None,
    creds: CredsOpt = None,
    run_dir: RunDirOpt = DEFAULT_RUN_DIR,
) -> None:
    """One dead letter: why its consumer gave up, where the message came from, and the message itself (exit 1 if
    there is no such letter).

    Example: gpuaas dlq show 42 -o yaml"""
    if not re.fullmatch(r"[1-9][0-9]{0,18}", seq):
        raise fail(f"[red]invalid dead letter id {seq!r}[/]: not a stream sequence number", EXIT_USAGE)
    number = int(seq)

    async def run() -> Optional[dict[str, Any]]:
        nc, js = await _jetstream(nats_url, creds, run_dir, timeout)
        try:
            msg = await _guarded(_read(js, number), timeout)
            return letter(msg.seq, msg.data) if msg is not None else None
        finally:
            await nc.close()

    doc = asyncio.run(run())
    if doc is None:
        raise not_found("dead letter", number)
    if getattr(output, "value", output) in ("json", "yaml"):
        emit(doc, output)
        return
    emit(doc, output, fields=SHOW_FIELDS)
    typer.echo("message:")
    typer.echo(json.dumps(doc["original"], indent=2, ensure_ascii=False) if doc["original"] is not None else "-")
