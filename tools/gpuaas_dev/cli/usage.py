"""`gpuaas usage export`: a month's usage records from the ops read models (ops-view's API, `GET /v1/usage`), for
billing: every page of the month fetched, then printed as csv, json, yaml or a table."""

from __future__ import annotations

import csv
import io
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from .admin_api import Endpoint, call, read_stack_json_file
from .common import DEFAULT_RUN_DIR, EXIT_USAGE, RunDirOpt, fail, no_stack, pid_alive, read_stack_json
from .output import FORMATS, Column, choices, emit

usage_app = typer.Typer(no_args_is_help=True, help="Usage records per allocation, from the ops read models.")

WHAT = "the ops API"
OpsUrlOpt = Annotated[
    Optional[str],
    typer.Option(
        "--ops-url",
        envvar="GPUAAS_OPS_ADMIN_URL",
        help="The ops API (ops-view). Default: the selected stack's (`ops_admin_url` in stack.json).",
    ),
]
# The export reads with the billing principal's token (usage records and nothing else), never the ops token:
# compose's .env names it GPUAAS_BILLING_TOKEN (and hands it to ops-view by the same name).
TokenOpt = Annotated[
    Optional[str],
    typer.Option(
        "--token",
        envvar="GPUAAS_BILLING_TOKEN",
        show_envvar=False,
        help="The billing principal's bearer token. Default: $GPUAAS_BILLING_TOKEN, else the selected stack's "
        "secrets.json (billing_token).",
    ),
]
ApiTimeoutOpt = Annotated[float, typer.Option("--timeout", min=0.1, help="Seconds to wait for each answer.")]
UsageFormat = choices("UsageFormat", (*FORMATS, "csv"))
UsageOutputOpt = Annotated[
    UsageFormat,  # type: ignore[valid-type]
    typer.Option(
        "--output",
        "-o",
        help="table (default), wide, csv (one row per record, for billing), json or yaml (records and totals).",
    ),
]
PAGE = 500

# The csv's columns, in order: what billing reads off each record.
CSV_FIELDS = (
    "allocation_id",
    "tenant_id",
    "shape",
    "sku",
    "gpu_count",
    "region",
    "node_id",
    "started_at",
    "stopped_at",
    "ended",
    "end_reason_code",
    "open",
    "seconds",
    "gpu_seconds",
    "record_seconds",
)
COLUMNS: list[Column] = [
    "allocation_id",
    ("TENANT", lambda r: r.get("tenant_id")),
    "shape",
    ("GPUS", lambda r: r.get("gpu_count")),
    "started_at",
    ("STOPPED-AT", lambda r: r.get("stopped_at") or ("(running)" if r.get("open") else None)),
    "seconds",
    "gpu_seconds",
]
WIDE: list[Column] = ["sku", "node_id", "ended", "end_reason_code", "record_seconds"]


def _endpoint(
    ops_url: Optional[str],
    token: Optional[str],
    run_dir: Path,
    timeout: float,
    secret: str = "billing_token",
    given: str = "pass --ops-url and --token (or $GPUAAS_OPS_ADMIN_URL and $GPUAAS_BILLING_TOKEN)",
) -> Endpoint:
    """The ops API and `token`, else the selected stack's with its `secret` of secrets.json."""
    info = read_stack_json(run_dir) or {}
    running = info.get("status") == "ready" and pid_alive(info.get("supervisor_pid"))
    url = ops_url or (info.get("ops_admin_url") if running else None)
    if not token and running:
        secrets = read_stack_json_file(Path(info.get("secrets_file") or run_dir / "secrets.json")) or {}
        token = secrets.get(secret)
    if not url or not token:
        raise no_stack("ops API", run_dir, given)
    if not url.startswith(("http://", "https://")):
        raise fail(f"[red]bad ops URL {url!r}[/]: expected http://host:port", EXIT_USAGE)
    return Endpoint(url.rstrip("/"), token, timeout, WHAT)


def fetch_month(ep: Endpoint, month: str, tenant: Optional[str]) -> dict[str, Any]:
    """Every record of the month, page after page; the totals and `as_of` of the first answer (a record still
    running is counted up to then)."""
    query: dict[str, Any] = {"month": month, "tenant": tenant, "limit": PAGE}
    doc = call(ep, "GET", "/v1/usage", query=query)
    items = list(doc["items"])
    cursor = doc.get("next_cursor")
    query["as_of"] = doc["as_of"]  # every page counts running records up to the same second as the totals
    while cursor:
        page = call(ep, "GET", "/v1/usage", query={**query, "cursor": cursor})
        items += page["items"]
        cursor = page.get("next_cursor")
    return {k: v for k, v in doc.items() if k not in ("items", "next_cursor")} | {"items": items}


def to_csv(items: list[dict[str, Any]]) -> str:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=CSV_FIELDS, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    for item in items:
        writer.writerow({k: ("" if item.get(k) is None else item.get(k)) for k in CSV_FIELDS})
    return buf.getvalue()


@usage_app.command("export")
def usage_export(
    month: Annotated[str, typer.Option("--month", help="The month, YYYY-MM (UTC).")],
    tenant: Annotated[Optional[str], typer.Option("--tenant", help="Only this tenant. Default: every tenant.")] = None,
    output: UsageOutputOpt = "table",
    run_dir: RunDirOpt = DEFAULT_RUN_DIR,
    ops_url: OpsUrlOpt = None,
    token: TokenOpt = None,
    timeout: ApiTimeoutOpt = 30.0,
) -> None:
    """A month's usage records: each allocation's seconds inside the month (from active to released or failed,
    to the second; a month boundary splits a record exactly), its shape, GPUs and SKU, and the month's totals.

    Example: gpuaas usage export --tenant acme --month 2026-11 -o csv > acme-2026-11.csv"""
    doc = fetch_month(_endpoint(ops_url, token, run_dir, timeout), month, tenant)
    fmt = getattr(output, "value", output)
    if fmt == "csv":
        typer.echo(to_csv(doc["items"]), nl=False)
        return
    if fmt in ("json", "yaml"):
        emit(doc, fmt)
        return
    emit(doc, fmt, rows=doc["items"], columns=COLUMNS, wide=WIDE)
    totals = doc["totals"]
    typer.echo(
        f"\n{doc['month']}: {totals['records']} records ({totals['open']} running, counted to {doc['as_of']}), "
        f"{totals['seconds']} s, {totals['gpu_seconds']} GPU-s"
    )
