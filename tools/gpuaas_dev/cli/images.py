"""`gpuaas images …`: build, list and inspect slice images through the image pipeline's admin API, with
progress bars fed by the bus (`image.build_progress`, `node.image_cache_reported`)."""

from __future__ import annotations

import asyncio
import json
import os
import time
import uuid
from pathlib import Path
from typing import Annotated, Any, Optional

import aiohttp
import typer
from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeElapsedColumn, TransferSpeedColumn
from rich.table import Table

from .identity_cli import cli_identity

err = Console(stderr=True, highlight=False)
images_app = typer.Typer(no_args_is_help=True, help="Slice images: build, publish, prewarm, status.")

RunDirOpt = Annotated[Path, typer.Option("--run-dir", help="Where the dev stack keeps its state.")]
AdminUrlOpt = Annotated[
    Optional[str], typer.Option("--admin-url", help="Default: $GPUAAS_IMAGE_ADMIN_URL, else stack.json.")
]
TokenOpt = Annotated[Optional[str], typer.Option("--token", help="Default: $GPUAAS_ADMIN_TOKEN, else secrets.json.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print the result as JSON on stdout.")]
DEFAULT_RUN_DIR = Path(".run/dev")
PHASES = ("customise", "convert", "pack", "push")


def _read(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _endpoint(admin_url: Optional[str], token: Optional[str], run_dir: Path) -> tuple[str, str]:
    url = admin_url or os.environ.get("GPUAAS_IMAGE_ADMIN_URL") or _read(run_dir / "stack.json").get("image_admin_url")
    tok = token or os.environ.get("GPUAAS_ADMIN_TOKEN") or _read(run_dir / "secrets.json").get("image_admin_token")
    if not url or not tok:
        err.print("[red]no image admin API[/]: pass --admin-url and --token, or start the stack (`gpuaas dev up`)")
        raise typer.Exit(2)
    return url.rstrip("/"), tok


async def _call(url: str, token: str, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    headers = {"Authorization": f"Bearer {token}"}
    if method != "GET":
        # One key per command: the API would replay it if this same request were sent again.
        headers["Idempotency-Key"] = uuid.uuid4().hex
    async with aiohttp.ClientSession(headers=headers) as http:
        try:
            async with http.request(method, f"{url}{path}", json=body) as resp:
                return resp.status, await resp.json()
        except aiohttp.ClientError as exc:
            err.print(f"[red]cannot reach the image admin API at {url}[/]: {exc}")
            raise typer.Exit(2) from None


def _fail(status: int, body: Any) -> None:
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict):
        err.print(
            f"[red]HTTP {status}[/]: {error.get('code')}: {error.get('message')} (request {error.get('request_id')})"
        )
    else:
        err.print(f"[red]HTTP {status}[/]: {body}")
    raise typer.Exit(1)


@images_app.command("list")
def images_list(
    run_dir: RunDirOpt = DEFAULT_RUN_DIR,
    admin_url: AdminUrlOpt = None,
    token: TokenOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """The catalog."""
    url, tok = _endpoint(admin_url, token, run_dir)
    status, body = asyncio.run(_call(url, tok, "GET", "/v1/images"))
    if status != 200:
        _fail(status, body)
    if as_json:
        print(json.dumps(body["images"], indent=2))
        return
    table = Table("slug", "kind", "status", "sku", "driver", "digest", "source")
    for i in body["images"]:
        table.add_row(
            i["slug"],
            i["kind"],
            i["status"],
            i["compatible_sku"],
            i["driver_strategy"],
            (i["digest_sha256"] or "")[:16],
            i["source_uri"] or "",
        )
    Console().print(table)


@images_app.command("status")
def images_status(
    slug: str,
    run_dir: RunDirOpt = DEFAULT_RUN_DIR,
    admin_url: AdminUrlOpt = None,
    token: TokenOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """A catalog row and the cache state of every slice host."""
    url, tok = _endpoint(admin_url, token, run_dir)
    status, body = asyncio.run(_call(url, tok, "GET", f"/v1/images/{slug}"))
    if status != 200:
        _fail(status, body)
    if as_json:
        print(json.dumps(body, indent=2))
        return
    out = Console()
    out.print(
        f"[bold]{body['slug']}[/] {body['status']}  digest {body['digest_sha256']}\n  {body['source_uri']}\n"
        f"  image_path {body['metadata'].get('image_path')}"
    )
    table = Table("node", "cache", "schedulable", "digest", "verified_at", "reason")
    for n in body["nodes"]:
        table.add_row(
            n["node_id"],
            n["status"],
            "yes" if n["schedulable"] else "no",
            (n["digest_sha256"] or "")[:16],
            n["verified_at"] or "",
            n["reason"] or "",
        )
    out.print(table)


@images_app.command("build")
def images_build(
    slug: Annotated[str, typer.Option("--slug")],
    source: Annotated[Optional[Path], typer.Option("--source", help="Source qcow2 (or raw) image.")] = None,
    reuse_build: Annotated[
        Optional[str], typer.Option("--reuse-build", help="Republish this build's artifact.")
    ] = None,
    packages: Annotated[Optional[list[str]], typer.Option("--package", help="Package to install (repeatable).")] = None,
    customise: Annotated[Optional[str], typer.Option("--customise", help="stamp | virt-customize | none")] = None,
    tag: Annotated[Optional[str], typer.Option("--tag", help="Registry tag (default: UTC build time).")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the plan only.")] = False,
    no_catalog: Annotated[bool, typer.Option("--no-catalog", help="Publish without touching the catalog.")] = False,
    wait: Annotated[bool, typer.Option("--wait", help="Follow until active on every slice host.")] = False,
    timeout: Annotated[float, typer.Option("--timeout")] = 600.0,
    nats_url: Annotated[Optional[str], typer.Option("--nats-url")] = None,
    run_dir: RunDirOpt = DEFAULT_RUN_DIR,
    admin_url: AdminUrlOpt = None,
    token: TokenOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Build (or republish), push to the registry, catalog, prewarm every slice host."""
    url, tok = _endpoint(admin_url, token, run_dir)
    body = {
        "source": str(source.resolve()) if source else None,
        "reuse_build_id": reuse_build,
        "packages": packages or [],
        "customise": customise,
        "tag": tag,
        "dry_run": dry_run,
        "update_catalog": not no_catalog,
    }
    nats = nats_url or os.environ.get("GPUAAS_NATS_URL") or _read(run_dir / "stack.json").get("nats_url")
    identity = cli_identity(nats, None, run_dir, "ops") if nats else None
    result = asyncio.run(_build(url, tok, slug, body, wait and not dry_run, timeout, identity, as_json))
    if as_json:
        print(json.dumps(result, indent=2))
    raise typer.Exit(0 if result.get("ok", True) else 1)


async def _build(
    url: str, tok: str, slug: str, body: dict, wait: bool, timeout: float, identity: Any, as_json: bool
) -> dict[str, Any]:
    nc = None
    events: asyncio.Queue = asyncio.Queue()
    if wait and identity is not None:
        import nats

        # As ops: reads image events, writes nothing.
        nc = await nats.connect(**identity.connect_kwargs(), connect_timeout=3, max_reconnect_attempts=2)

        async def on_msg(msg: Any) -> None:
            try:
                await events.put(json.loads(msg.data))
            except ValueError:
                pass

        # Subscribed before the build starts, so no progress is missed.
        await nc.subscribe("gpuaas.image.event.>", cb=on_msg)
        await nc.subscribe("gpuaas.node.*.report.image_cache", cb=on_msg)
    try:
        status, build = await _call(url, tok, "POST", f"/v1/images/{slug}/builds", body)
        if status not in (200, 202):
            _fail(status, build)
        if body["dry_run"]:
            for step in build["plan"]["steps"]:
                err.print(f"  [cyan]plan[/] {step}")
            return {"build": build, "plan": build["plan"]}
        err.print(f"build {build['build_id']} of {slug} started -> {build['plan']['artifact_ref']}")
        if not wait:
            return {"build": build}
        return await _follow(url, tok, slug, build["build_id"], events, timeout, as_json)
    finally:
        if nc is not None:
            await nc.drain()


async def _follow(
    url: str, tok: str, slug: str, build_id: str, events: asyncio.Queue, timeout: float, as_json: bool
) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    columns = (
        TextColumn("{task.description:<28}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeElapsedColumn(),
    )
    bars: dict[str, Any] = {}
    with Progress(*columns, console=err, transient=as_json) as progress:

        def bar(key: str, total: int) -> Any:
            if key not in bars:
                bars[key] = progress.add_task(key, total=max(total, 1))
            return bars[key]

        next_poll = 0.0
        while time.monotonic() < deadline:
            try:
                ev = await asyncio.wait_for(events.get(), timeout=0.3)
            except asyncio.TimeoutError:
                ev = None
            if ev:
                p, t = ev.get("payload", {}), ev.get("type")
                if t == "image.build_progress" and p.get("build_id") == build_id and p["phase"] in PHASES:
                    progress.update(
                        bar(p["phase"], p["bytes_total"]), completed=p["bytes_done"], total=max(p["bytes_total"], 1)
                    )
                elif t == "node.image_cache_reported" and p.get("slug") == slug:
                    key = f"pull {p['node_id']}"
                    done = p["bytes_total"] if p["status"] == "verified" else p["bytes_done"]
                    progress.update(bar(key, p["bytes_total"]), completed=done, description=f"{key} [{p['status']}]")
            if time.monotonic() >= next_poll:
                next_poll = time.monotonic() + 1.0
                _, build = await _call(url, tok, "GET", f"/v1/builds/{build_id}")
                if build["status"] == "failed":
                    err.print(f"[red]build failed[/]: {build['error']}")
                    return {"ok": False, "build": build}
                if build["status"] == "published":
                    _, image = await _call(url, tok, "GET", f"/v1/images/{slug}")
                    if image["status"] == "active" and image["digest_sha256"] == build["raw_sha256"]:
                        err.print(f"[green]{slug} active[/] with digest {image['digest_sha256']}")
                        return {"ok": True, "build": build, "image": image}
                    if any(
                        n["status"] in ("mismatch", "failed") and n["expected_digest"] == build["raw_sha256"]
                        for n in image["nodes"]
                    ):
                        bad = [n["node_id"] for n in image["nodes"] if n["status"] in ("mismatch", "failed")]
                        err.print(f"[red]{slug} not active[/]: cache not verified on {', '.join(bad)}")
                        return {"ok": False, "build": build, "image": image}
    err.print("[red]timed out[/]")
    return {"ok": False, "build_id": build_id}
