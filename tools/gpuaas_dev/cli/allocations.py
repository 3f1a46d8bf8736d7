"""`gpuaas allocations list|show|wait`: read allocations from the allocator, which owns them.

Asked over the bus (`allocation.query`, request/reply) as the ops identity: reading needs no database
credentials and no admin token, and the ops identity still cannot change anything. An allocation prints as one
JSON shape everywhere: the query's summary, with its `timeline` where one allocation is shown (show, wait).
"""

from __future__ import annotations

import asyncio
import json
import shutil
import sys
import time
import uuid
from typing import Annotated, Any, Optional

import typer

from gpuaas_common.contract import AllocationState as A
from gpuaas_common.contract import Shape

from .bus import ALLOCATION_EVENTS, bus_identity, connect, describe_event, resolve_nats_url
from .common import (
    DEFAULT_RUN_DIR,
    EXIT_FAILED,
    EXIT_OK,
    EXIT_TIMEOUT,
    EXIT_UNREACHABLE,
    EXIT_USAGE,
    CredsOpt,
    NatsUrlOpt,
    RunDirOpt,
    bad_id,
    err,
    fail,
    not_found,
    timed_out,
)
from .output import Column, IntervalOpt, OutputOpt, WatchOpt, age, age_of, choices, render, watch

allocations_app = typer.Typer(
    no_args_is_help=True, help="Read allocations from the allocator (as the ops identity; changes nothing)."
)

LegacyJsonOpt = Annotated[bool, typer.Option("--json", help="The same as -o json.")]
TimeoutOpt = Annotated[float, typer.Option("--timeout", min=0.1, help="Seconds to wait for the allocator's answer.")]
# The states an allocation is answered in (`requested` never leaves the allocator's transaction).
STATES = tuple(s.value for s in A if s != A.REQUESTED)
SHORT_SHAPE = {Shape.GPU_SLICE: "slice", Shape.BAREMETAL: "bm"}
# The table's columns, one space apart, each as wide as its widest cell but no wider than this (the full id, so
# it can be pasted; a longer tenant or node is cut with …). The usual rows (an 8-letter tenant and node) fit 80
# columns in every state; the widest a row can be is 84.
COLUMNS = (("ALLOCATION", 36), ("TENANT", 8), ("SHAPE", 7), ("STATE", 13), ("NODE", 11), ("AGE", 4))


def _query(identity: Any, query: Any, timeout: float) -> Any:
    """Send one allocation.query and return the validated AllocationQueryResult."""
    import nats.errors

    from gpuaas_common.allocation_queries import ask_allocator
    from gpuaas_common.contract import spec_for

    async def run() -> Any:
        nc = await connect(identity)
        try:
            try:
                return await ask_allocator(
                    nc, query, producer="gpuaas-cli", correlation_id="cli-query", timeout_s=timeout
                )
            except nats.errors.NoRespondersError:
                subject = spec_for("allocation.query").subject()
                raise fail(
                    f"[red]no allocator answers on {subject}[/] (is the allocator running?)", EXIT_UNREACHABLE
                ) from None
            except nats.errors.TimeoutError:
                raise timed_out("the allocator", timeout) from None
        finally:
            await nc.drain()

    return asyncio.run(run())


def _ask(query: Any, timeout: float, nats_url: Optional[str], creds: Any, run_dir: Any) -> Any:
    url = resolve_nats_url(nats_url, run_dir)
    result = _query(bus_identity(url, creds, run_dir, "ops"), query, timeout)
    if result.status == "invalid":
        raise fail(f"[red]the allocator refused the query[/]: {result.reason}", EXIT_USAGE)
    return result


def _cell(value: Any, width: int) -> str:
    text = "-" if value in (None, "") else str(value)
    return text if len(text) <= width else text[: width - 1] + "…"


def table_lines(allocations: list[Any]) -> list[str]:
    """The list as a narrow table (see COLUMNS), AGE since it was requested; -o wide and --json have more."""
    cells = [
        [_cell(v, w) for v, (_, w) in zip(values, COLUMNS, strict=True)]
        for values in (
            [
                a.allocation_id,
                a.tenant_id,
                f"{a.gpu_count} {SHORT_SHAPE.get(a.shape, a.shape)}",
                a.state,
                a.node_id,
                age(a.created_at),
            ]
            for a in allocations
        )
    ]
    grid = [[name for name, _ in COLUMNS], *cells]
    widths = [max(len(line[i]) for line in grid) for i in range(len(COLUMNS))]
    return [" ".join(v.ljust(w) for v, w in zip(line, widths, strict=True)).rstrip() for line in grid]


WIDE: list[Column] = [
    "allocation_id",
    "tenant_id",
    ("SHAPE", lambda a: f"{a['gpu_count']} {SHORT_SHAPE.get(a['shape'], a['shape'])}"),
    "state",
    "node_id",
    age_of("created_at"),
    "image",
    "region",
    ("UPDATED", lambda a: age(a.get("updated_at"))),
]


def _format(output: Any, as_json: bool) -> str:
    return "json" if as_json else getattr(output, "value", output)


def _list_doc(result: Any) -> dict[str, Any]:
    return {"allocations": [a.model_dump(mode="json") for a in result.allocations], "truncated": result.truncated}


def _show_doc(result: Any) -> dict[str, Any]:
    return {
        **result.allocations[0].model_dump(mode="json"),
        "timeline": [t.model_dump(mode="json") for t in result.timeline],
    }


def show_text(doc: dict[str, Any], output: str, compact: bool = False) -> str:
    """One allocation as `allocations show` prints it, from its JSON shape."""
    if output in ("json", "yaml"):
        return render(doc, output, compact=compact)
    access = {k: _yes_no(v) for k, v in (doc.get("access") or {}).items() if v is not None}
    fields = [
        ("allocation", doc["allocation_id"]),
        ("tenant", doc["tenant_id"]),
        ("shape", f"{doc['shape']}, {doc['gpu_count']} GPU, SKU {doc['sku']}, region {doc['region']}"),
        ("image", doc["image"]),
        ("state", doc["state"]),
        ("node", doc.get("node_id")),
        ("access", ", ".join(f"{k} {v}" for k, v in access.items()) or None),
        ("failure", f"{doc['failure_code']}: {doc.get('failure_reason')}" if doc.get("failure_code") else None),
        ("created", f"{doc['created_at'][:19]} ({age(doc['created_at'])} ago)"),
        ("updated", f"{doc['updated_at'][:19]} ({age(doc['updated_at'])} ago)"),
    ]
    lines = [f"{name:<11}{value}" for name, value in fields if value is not None]
    lines.append("timeline")
    width = shutil.get_terminal_size((80, 24)).columns
    for t in doc.get("timeline", []):
        why = f" ({t['reason_code']}{_phase(t.get('detail'))})" if t.get("reason_code") else ""
        at = t["at"][:19].replace("T", " ")
        line = f"  {t['seq']:>2} {at} {t.get('previous_state') or '-'} -> {t['state']}{why}"
        lines.append(line if len(line) <= width or not sys.stdout.isatty() else line[: width - 1] + "…")
    return "\n".join(lines)


def _yes_no(value: Any) -> Any:
    return ("yes" if value else "no") if isinstance(value, bool) else value


def _phase(detail: Any) -> str:
    """A provisioning phase's name and how long it took, from its timeline entry's detail."""
    if not isinstance(detail, dict) or not detail.get("phase"):
        return ""
    seconds = detail.get("seconds")
    return f": {detail['phase']}" + (f" {seconds:.2f}s" if isinstance(seconds, (int, float)) else "")


def _parse_id(allocation_id: str) -> uuid.UUID:
    try:
        return uuid.UUID(allocation_id)
    except ValueError:
        raise bad_id("allocation", allocation_id) from None


@allocations_app.command("list")
def allocations_list(
    tenant: Annotated[Optional[str], typer.Option("--tenant", help="Only this tenant's allocations.")] = None,
    state: Annotated[
        Optional[str], typer.Option("--state", help=f"Only allocations in this state: {', '.join(STATES)}.")
    ] = None,
    node: Annotated[Optional[str], typer.Option("--node", help="Only allocations placed on this node.")] = None,
    limit: Annotated[int, typer.Option("--limit", min=1, max=1000, help="At most this many, newest first.")] = 100,
    output: OutputOpt = "table",
    watching: WatchOpt = False,
    interval: IntervalOpt = 2.0,
    as_json: LegacyJsonOpt = False,
    timeout: TimeoutOpt = 10.0,
    nats_url: NatsUrlOpt = None,
    creds: CredsOpt = None,
    run_dir: RunDirOpt = DEFAULT_RUN_DIR,
) -> None:
    """Allocations, newest first, filtered by tenant, state and node (all given filters must match).

    Example: gpuaas allocations list --state active -o wide --watch"""
    from pydantic import ValidationError

    from gpuaas_common.contract.messages import AllocationQuery

    if state is not None and state not in STATES:
        raise fail(f"[red]invalid --state[/]: {state!r}; must be one of {', '.join(STATES)}", EXIT_USAGE)
    try:
        query = AllocationQuery(tenant_id=tenant, state=state, node_id=node, limit=limit)
    except ValidationError as exc:
        bad = "; ".join(f"--{str(e['loc'][0]).split('_')[0]}: {e['msg']}" for e in exc.errors())
        raise fail(f"[red]invalid filter[/]: {bad}", EXIT_USAGE) from None
    fmt = _format(output, as_json)

    def show(result: Any, compact: bool) -> str:
        if fmt == "table":
            # Narrow, with full ids; -o wide has the image, region and UPDATED too.
            return "\n".join(table_lines(result.allocations))
        doc = _list_doc(result)
        return render(doc, fmt, rows=doc["allocations"], columns=WIDE, compact=compact)

    def fetch() -> Any:
        return _ask(query, timeout, nats_url, creds, run_dir)

    if watching:
        watch(fetch, show, interval, key=lambda result: _list_doc(result))
        return
    result = fetch()
    typer.echo(show(result, False))
    if result.truncated:
        print(f"(more than {limit} match; narrow the filters or raise --limit)", file=sys.stderr)
    elif not result.allocations:
        print("no allocations match", file=sys.stderr)


@allocations_app.command("show")
def allocations_show(
    allocation_id: Annotated[str, typer.Argument(help="The allocation's UUID.")],
    output: OutputOpt = "table",
    watching: WatchOpt = False,
    interval: IntervalOpt = 2.0,
    as_json: LegacyJsonOpt = False,
    timeout: TimeoutOpt = 10.0,
    nats_url: NatsUrlOpt = None,
    creds: CredsOpt = None,
    run_dir: RunDirOpt = DEFAULT_RUN_DIR,
) -> None:
    """One allocation: its request, where it runs, how to reach it, and its timeline (exit 1 if unknown).

    Example: gpuaas allocations show "$ID" -o yaml"""
    from gpuaas_common.contract.messages import AllocationQuery

    alloc = _parse_id(allocation_id)
    fmt = _format(output, as_json)

    def fetch() -> dict[str, Any]:
        result = _ask(AllocationQuery(allocation_id=alloc, limit=1), timeout, nats_url, creds, run_dir)
        if result.status == "not_found":
            raise not_found("allocation", alloc)
        return _show_doc(result)

    if watching:
        watch(fetch, lambda doc, compact: show_text(doc, fmt, compact), interval)
        return
    typer.echo(show_text(fetch(), fmt))


Target = choices("Target", (A.ACTIVE.value, A.RELEASED.value))
# What ends a wait, per target: the states that answer it, and those that mean it will never come.
WAIT_OK = {A.ACTIVE: {A.ACTIVE}, A.RELEASED: {A.RELEASED}}
WAIT_FAIL = {
    A.ACTIVE: {"rejected", A.UNSCHEDULABLE, A.FAILED, A.RELEASING, A.RELEASED},
    A.RELEASED: {"rejected", A.UNSCHEDULABLE, A.FAILED},
}


@allocations_app.command("wait")
def allocations_wait(
    allocation_id: Annotated[str, typer.Argument(help="The allocation's UUID.")],
    for_state: Annotated[
        Target,  # type: ignore[valid-type]
        typer.Option("--for", help="active (default; a failure or a release ends it with 1) or released."),
    ] = "active",
    output: OutputOpt = "table",
    timeout: Annotated[float, typer.Option("--timeout", min=0.1, help="Seconds to wait (exit 4 after).")] = 180.0,
    nats_url: NatsUrlOpt = None,
    creds: CredsOpt = None,
    run_dir: RunDirOpt = DEFAULT_RUN_DIR,
) -> None:
    """Follow an allocation (again, e.g. after `allocate --wait` timed out) until it is active or released: exit 0,
    1 if it failed or ended otherwise, 4 on --timeout. Prints it as `allocations show` does.

    Example: gpuaas allocations wait "$ID" --for released --timeout 600 -o json"""
    from gpuaas_common.contract.messages import AllocationQuery

    alloc = _parse_id(allocation_id)
    target = getattr(for_state, "value", for_state)
    fmt = getattr(output, "value", output)
    url = resolve_nats_url(nats_url, run_dir)
    identity = bus_identity(url, creds, run_dir, "ops")
    query = AllocationQuery(allocation_id=alloc, limit=1)
    ask_s = min(10.0, timeout)

    async def run() -> tuple[str, dict[str, Any]]:
        import nats.errors

        from gpuaas_common.allocation_queries import ask_allocator

        nc = await connect(identity)
        queue: asyncio.Queue = asyncio.Queue()

        async def on_msg(msg: Any) -> None:
            await queue.put(msg)

        async def ask() -> Any:
            try:
                result = await ask_allocator(
                    nc, query, producer="gpuaas-cli", correlation_id="cli-wait", timeout_s=ask_s
                )
            except nats.errors.NoRespondersError:
                raise fail("[red]no allocator answers allocation queries[/] (is the allocator running?)",
                           EXIT_UNREACHABLE) from None  # fmt: skip
            except nats.errors.TimeoutError:
                raise timed_out("the allocator", ask_s) from None
            if result.status == "not_found":
                raise not_found("allocation", alloc)
            return result

        try:
            # Subscribed before asking: a transition between the answer and the subscription is not lost.
            await nc.subscribe(ALLOCATION_EVENTS, cb=on_msg)
            await nc.flush()
            t0 = time.monotonic()
            state = (await ask()).allocations[0].state
            err.print(f"[dim]+0.00s[/] {state} [bold]{alloc}[/]")
            while state not in WAIT_OK[target] | WAIT_FAIL[target]:
                remaining = t0 + timeout - time.monotonic()
                if remaining <= 0:
                    return "timeout", {"state": state}
                try:
                    msg = await asyncio.wait_for(queue.get(), remaining)
                    data = json.loads(msg.data)
                    payload, kind = data["payload"], data["type"].split(".", 1)[1]
                except asyncio.TimeoutError:
                    continue
                except (ValueError, KeyError, TypeError, IndexError):
                    continue
                if str(payload.get("allocation_id")) != str(alloc) or kind == "release_rejected":
                    continue
                err.print(f"[dim]+{time.monotonic() - t0:.2f}s[/] {describe_event(kind, payload)}")
                state = kind
            return ("ok" if state in WAIT_OK[target] else "fail"), _show_doc(await ask())
        finally:
            await nc.drain()

    verdict, doc = asyncio.run(run())
    if verdict == "timeout":
        raise fail(f"[red]timed out after {timeout:g}s[/] in state {doc['state']}", EXIT_TIMEOUT)
    typer.echo(show_text(doc, fmt))
    if verdict != "ok":
        err.print(f"[red]allocation {alloc} is {doc['state']}[/]: it will not become {target}")
    raise typer.Exit(EXIT_OK if verdict == "ok" else EXIT_FAILED)
