"""`gpuaas allocations list|show`: read allocations from the allocator, which owns them.

Asked over the bus (`allocation.query`, request/reply) as the ops identity: reading needs no database
credentials and no admin token, and the ops identity still cannot change anything.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import sys
import uuid
from typing import Annotated, Any, Optional

import typer

from .bus import bus_identity, connect, resolve_nats_url
from .common import (
    DEFAULT_RUN_DIR,
    EXIT_FAILED,
    EXIT_TIMEOUT,
    EXIT_UNREACHABLE,
    EXIT_USAGE,
    CredsOpt,
    JsonOpt,
    NatsUrlOpt,
    RunDirOpt,
    fail,
)

allocations_app = typer.Typer(
    no_args_is_help=True, help="Read allocations from the allocator (as the ops identity; changes nothing)."
)

TimeoutOpt = Annotated[float, typer.Option("--timeout", min=0.1, help="Seconds to wait for the allocator's answer.")]
STATES = ("accepted", "placed", "provisioning", "active", "releasing", "released", "unschedulable", "failed")
SHORT_SHAPE = {"gpu_slice": "slice", "baremetal": "bm"}
# ALLOCATION (36) TENANT (8) SHAPE (7) STATE (13) NODE (11), one space apart: 79 columns.
COLUMNS = (("ALLOCATION", 36), ("TENANT", 8), ("SHAPE", 7), ("STATE", 13), ("NODE", 11))


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
                raise fail(f"[red]the allocator did not answer within {timeout:.0f}s[/]", EXIT_TIMEOUT) from None
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
    """The list as fixed columns that fit an 80-column terminal; --json has every field."""

    def row(values: list[Any]) -> str:
        return " ".join(_cell(v, w).ljust(w) for v, (_, w) in zip(values, COLUMNS, strict=True)).rstrip()

    lines = [row([name for name, _ in COLUMNS])]
    for a in allocations:
        shape = f"{a.gpu_count} {SHORT_SHAPE.get(a.shape, a.shape)}"
        lines.append(row([a.allocation_id, a.tenant_id, shape, a.state, a.node_id]))
    return lines


@allocations_app.command("list")
def allocations_list(
    tenant: Annotated[Optional[str], typer.Option("--tenant", help="Only this tenant's allocations.")] = None,
    state: Annotated[
        Optional[str], typer.Option("--state", help=f"Only allocations in this state: {', '.join(STATES)}.")
    ] = None,
    node: Annotated[Optional[str], typer.Option("--node", help="Only allocations placed on this node.")] = None,
    limit: Annotated[int, typer.Option("--limit", min=1, max=1000, help="At most this many, newest first.")] = 100,
    as_json: JsonOpt = False,
    timeout: TimeoutOpt = 10.0,
    nats_url: NatsUrlOpt = None,
    creds: CredsOpt = None,
    run_dir: RunDirOpt = DEFAULT_RUN_DIR,
) -> None:
    """Allocations, newest first, filtered by tenant, state and node (all given filters must match)."""
    from pydantic import ValidationError

    from gpuaas_common.contract.messages import AllocationQuery

    if state is not None and state not in STATES:
        raise fail(f"[red]invalid --state[/]: {state!r}; must be one of {', '.join(STATES)}", EXIT_USAGE)
    try:
        query = AllocationQuery(tenant_id=tenant, state=state, node_id=node, limit=limit)
    except ValidationError as exc:
        bad = "; ".join(f"--{str(e['loc'][0]).split('_')[0]}: {e['msg']}" for e in exc.errors())
        raise fail(f"[red]invalid filter[/]: {bad}", EXIT_USAGE) from None
    result = _ask(query, timeout, nats_url, creds, run_dir)
    if as_json:
        typer.echo(
            json.dumps(
                {
                    "allocations": [a.model_dump(mode="json") for a in result.allocations],
                    "truncated": result.truncated,
                },
                indent=2,
            )
        )
        return
    for line in table_lines(result.allocations):
        typer.echo(line)
    if result.truncated:
        print(f"(more than {limit} match; narrow the filters or raise --limit)", file=sys.stderr)
    elif not result.allocations:
        print("no allocations match", file=sys.stderr)


@allocations_app.command("show")
def allocations_show(
    allocation_id: Annotated[str, typer.Argument(help="The allocation's UUID.")],
    as_json: JsonOpt = False,
    timeout: TimeoutOpt = 10.0,
    nats_url: NatsUrlOpt = None,
    creds: CredsOpt = None,
    run_dir: RunDirOpt = DEFAULT_RUN_DIR,
) -> None:
    """One allocation: its request, where it runs, how to reach it, and its timeline (exit 1 if unknown)."""
    from gpuaas_common.contract.messages import AllocationQuery

    try:
        alloc = uuid.UUID(allocation_id)
    except ValueError:
        raise fail(f"[red]invalid allocation id {allocation_id!r}[/]: not a UUID", EXIT_USAGE) from None
    result = _ask(AllocationQuery(allocation_id=alloc, limit=1), timeout, nats_url, creds, run_dir)
    if result.status == "not_found":
        raise fail(f"[red]no allocation {alloc}[/]", EXIT_FAILED)
    a = result.allocations[0]
    if as_json:
        typer.echo(
            json.dumps(
                {**a.model_dump(mode="json"), "timeline": [t.model_dump(mode="json") for t in result.timeline]},
                indent=2,
            )
        )
        return
    access = a.access.model_dump(exclude_none=True) if a.access else {}
    fields = [
        ("allocation", a.allocation_id),
        ("tenant", a.tenant_id),
        ("shape", f"{a.shape}, {a.gpu_count} GPU, SKU {a.sku}, region {a.region}"),
        ("image", a.image),
        ("state", a.state),
        ("node", a.node_id),
        ("access", ", ".join(f"{k} {v}" for k, v in access.items()) or None),
        ("failure", f"{a.failure_code}: {a.failure_reason}" if a.failure_code else None),
        ("created", a.created_at.isoformat(timespec="seconds")),
        ("updated", a.updated_at.isoformat(timespec="seconds")),
    ]
    for name, value in fields:
        if value is not None:
            typer.echo(f"{name:<11}{value}")
    typer.echo("timeline")
    width = shutil.get_terminal_size((80, 24)).columns
    for t in result.timeline:
        why = f" ({t.reason_code})" if t.reason_code else ""
        line = f"  {t.seq:>2} {t.at.strftime('%Y-%m-%d %H:%M:%S')} {t.previous_state or '-'} -> {t.state}{why}"
        typer.echo(line if len(line) <= width or not sys.stdout.isatty() else line[: width - 1] + "…")
