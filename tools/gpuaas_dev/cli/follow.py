"""Following one allocation's lifecycle on the bus after a portal command publishes its request."""

import asyncio
import json
import time
from datetime import datetime, timezone
from typing import Any, Callable, Optional

import typer

from .bus import ALLOCATION_EVENTS, TASK_PROGRESS, connect, describe_event, publish_event
from .common import EXIT_FAILED, EXIT_OK, EXIT_TIMEOUT, err


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat()


# What an answer means to a command following one allocation: "ok" ends it with success, "fail" with a
# failure, None keeps following.
Decide = Callable[[str, dict[str, Any]], Optional[str]]


async def follow(
    nc,
    allocation_id: str,
    start: Any,
    decide: Decide,
    timeout: float,
    initial: str,
    progress: bool = False,
) -> dict[str, Any]:
    """Subscribe first, then publish (`start`), then print events for one allocation until `decide` ends it.

    `progress` adds the agents' task phases, which only identities that read reports may see (not a portal)."""
    queue: asyncio.Queue = asyncio.Queue()

    async def on_msg(msg) -> None:
        await queue.put(msg)

    subs = [await nc.subscribe(ALLOCATION_EVENTS, cb=on_msg)]
    if progress:
        subs.append(await nc.subscribe(TASK_PROGRESS, cb=on_msg))
    await nc.flush()  # the server knows our interest before the request can cause any event
    t0 = time.monotonic()
    result: dict[str, Any] = {
        "allocation_id": allocation_id,
        "state": initial,
        "outcome": None,
        "node_id": None,
        "timed_out": False,
        "timeline": [{"state": initial, "at": now_iso(), "elapsed_s": 0.0}],
    }
    await start()
    err.print(f"[dim]+0.00s[/] {initial} [bold]{allocation_id}[/]")
    deadline = t0 + timeout
    try:
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                result["timed_out"] = True
                err.print(f"[red]timed out after {timeout:.0f}s[/] in state {result['state']}")
                return result
            try:
                msg = await asyncio.wait_for(queue.get(), remaining)
            except asyncio.TimeoutError:
                continue
            try:
                data = json.loads(msg.data)
                payload = data["payload"]
                type_ = data["type"]
            except (ValueError, KeyError, TypeError):
                continue
            if str(payload.get("allocation_id")) != allocation_id:
                continue
            elapsed = time.monotonic() - t0
            if type_ == "node.task_progress":
                detail = f" — {payload['detail']}" if payload.get("detail") else ""
                err.print(
                    f"[dim]+{elapsed:.2f}s[/]   · {payload.get('node_id')} {payload.get('task_type')}: "
                    f"{payload.get('phase')}{detail}"
                )
                continue
            if not type_.startswith("allocation."):
                continue
            kind = type_.split(".", 1)[1]
            if kind == "release_rejected":
                # An answer about the request, not a transition: the allocation keeps its state.
                result["state"] = payload.get("state") or "unknown"
            else:
                result["state"] = kind
                result["timeline"].append(
                    {"state": kind, "at": data.get("occurred_at"), "elapsed_s": round(elapsed, 3)}
                )
            result["node_id"] = payload.get("node_id") or result["node_id"]
            for key in ("reason_code", "reason", "access", "cleanup"):
                if payload.get(key) is not None:
                    result[key] = payload[key]
            err.print(f"[dim]+{elapsed:.2f}s[/] {describe_event(kind, payload)}")
            verdict = decide(kind, payload)
            if verdict is not None:
                result["outcome"] = kind
                result["ok"] = verdict == "ok"
                return result
    finally:
        for sub in subs:
            await sub.unsubscribe()


def finish(result: dict[str, Any], as_json: bool, print_id: bool = False) -> None:
    if as_json:
        typer.echo(json.dumps(result, indent=2, default=str))
    elif print_id:
        # The id alone on stdout, so `ID=$(gpuaas allocate …)` works; the story went to stderr.
        typer.echo(result["allocation_id"])
    if result.get("timed_out"):
        raise typer.Exit(EXIT_TIMEOUT)
    raise typer.Exit(EXIT_OK if result.get("ok") else EXIT_FAILED)


def publish_and_follow(
    identity: Any,
    type_: str,
    request: Any,
    *,
    follow_answer: bool,
    timeout: float,
    initial: str,
    said: str,
    decide: Decide,
    as_json: bool,
    print_id: bool = False,
) -> None:
    """Publish a portal message; with `follow_answer`, follow the allocation until `decide` ends it."""
    alloc = str(request.allocation_id)

    async def run() -> dict[str, Any]:
        nc = await connect(identity)
        js = nc.jetstream()
        try:

            async def publish() -> None:
                await publish_event(js, type_, request.model_dump(mode="json"), alloc)

            if not follow_answer:
                await publish()
                err.print(f"{said} [bold]{alloc}[/]")
                return {
                    "allocation_id": alloc,
                    "state": initial,
                    "outcome": None,
                    "ok": True,
                    "node_id": None,
                    "timed_out": False,
                    "timeline": [{"state": initial, "at": now_iso(), "elapsed_s": 0.0}],
                }
            return await follow(
                nc,
                alloc,
                publish,
                decide,
                timeout,
                initial,
                progress=identity.name in ("ops", "admin", "anonymous"),
            )
        finally:
            await nc.drain()

    finish(asyncio.run(run()), as_json, print_id)
