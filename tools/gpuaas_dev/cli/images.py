"""`gpuaas images …`: build, list and inspect slice images through the image pipeline's admin API, with
progress bars fed by the bus (`image.build_progress`, `node.image_cache_reported`)."""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeElapsedColumn, TransferSpeedColumn

from ..identity_cli import cli_identity
from .admin_api import Endpoint, IdempotencyOpt, call, quote, read_stack_json_file
from .common import (
    DEFAULT_RUN_DIR,
    EXIT_FAILED,
    EXIT_TIMEOUT,
    EXIT_UNREACHABLE,
    EXIT_USAGE,
    CredsOpt,
    RunDirOpt,
    err,
    fail,
    no_stack,
    pid_alive,
    read_stack_json,
)
from .output import Column, OutputOpt, age, age_of, choices, emit

images_app = typer.Typer(no_args_is_help=True, help="Slice images: build, publish, prewarm, status; MAAS host images.")

WHAT = "the image pipeline admin API"
AdminUrlOpt = Annotated[
    Optional[str],
    typer.Option(
        "--admin-url",
        envvar="GPUAAS_IMAGE_ADMIN_URL",
        help="The image pipeline admin API. Default: the selected stack's (`gpuaas context show`).",
    ),
]
# compose's .env names the image pipeline's token GPUAAS_IMAGE_ADMIN_TOKEN (and hands it to the service as
# GPUAAS_ADMIN_TOKEN): the specific name wins, the service's own name is the fallback.
TokenOpt = Annotated[
    Optional[str],
    typer.Option(
        "--token",
        envvar=["GPUAAS_IMAGE_ADMIN_TOKEN", "GPUAAS_ADMIN_TOKEN"],
        show_envvar=False,
        help="Its bearer token. Default: $GPUAAS_IMAGE_ADMIN_TOKEN, else $GPUAAS_ADMIN_TOKEN, else the selected "
        "stack's secrets.json.",
    ),
]
ApiTimeoutOpt = Annotated[float, typer.Option("--timeout", min=0.1, help="Seconds to wait for the API's answer.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print the result as JSON on stdout.")]
PHASES = ("customise", "convert", "pack", "push")


def _endpoint(admin_url: Optional[str], token: Optional[str], run_dir: Path, timeout: float) -> Endpoint:
    info = read_stack_json(run_dir) or {}
    running = info.get("status") == "ready" and pid_alive(info.get("supervisor_pid"))
    url = admin_url or (info.get("image_admin_url") if running else None)
    if not token and running:
        secrets = read_stack_json_file(Path(info.get("secrets_file") or run_dir / "secrets.json")) or {}
        token = secrets.get("image_admin_token")
    if not url or not token:
        raise no_stack(
            "image admin API",
            run_dir,
            "pass --admin-url and --token (or $GPUAAS_IMAGE_ADMIN_URL and $GPUAAS_IMAGE_ADMIN_TOKEN)",
        )
    if not url.startswith(("http://", "https://")):
        raise fail(f"[red]bad admin URL {url!r}[/]: expected http://host:port", EXIT_USAGE)
    return Endpoint(url.rstrip("/"), token, timeout, WHAT)


IMAGE_COLUMNS: list[Column] = [
    "slug",
    "kind",
    "status",
    ("SKU", lambda i: i.get("compatible_sku")),
    ("DRIVER", lambda i: i.get("driver_strategy")),
    ("DIGEST", lambda i: (i.get("digest_sha256") or "")[:16]),
    age_of("created_at"),
]
IMAGE_WIDE: list[Column] = [
    ("UPDATED", lambda i: age(i.get("updated_at"))),
    ("SOURCE", lambda i: i.get("source_uri")),
    ("DIGEST-SHA256", lambda i: i.get("digest_sha256")),
]
CACHE_COLUMNS: list[Column] = [
    "node_id",
    ("CACHE", lambda n: n.get("status")),
    "schedulable",
    ("DIGEST", lambda n: (n.get("digest_sha256") or "")[:16]),
    # How long ago the host last checked its copy (-o json has the time itself).
    ("VERIFIED", lambda n: age(n.get("verified_at"))),
    "reason",
]
# The --json of earlier releases: the same document as -o json, kept for scripts that pass it.
LegacyJsonOpt = Annotated[bool, typer.Option("--json", hidden=True, help="The same as -o json.")]


def _format(output: Any, as_json: bool) -> Any:
    return "json" if as_json else output


@images_app.command("list")
def images_list(
    output: OutputOpt = "table",
    run_dir: RunDirOpt = DEFAULT_RUN_DIR,
    admin_url: AdminUrlOpt = None,
    token: TokenOpt = None,
    timeout: ApiTimeoutOpt = 30.0,
    as_json: LegacyJsonOpt = False,
) -> None:
    """The catalog: every image with its status, SKU, driver strategy and digest.

    Example: gpuaas images list -o wide"""
    doc = call(_endpoint(admin_url, token, run_dir, timeout), "GET", "/v1/images")
    emit(doc, _format(output, as_json), rows=doc["images"], columns=IMAGE_COLUMNS, wide=IMAGE_WIDE)


@images_app.command("status")
def images_status(
    slug: Annotated[str, typer.Argument(help="The image's catalog slug.")],
    output: OutputOpt = "table",
    run_dir: RunDirOpt = DEFAULT_RUN_DIR,
    admin_url: AdminUrlOpt = None,
    token: TokenOpt = None,
    timeout: ApiTimeoutOpt = 30.0,
    as_json: LegacyJsonOpt = False,
) -> None:
    """A catalog row and the cache state of every slice host (exit 1 if unknown).

    Example: gpuaas images status debian-12-lab -o yaml"""
    ep = _endpoint(admin_url, token, run_dir, timeout)
    doc = call(ep, "GET", f"/v1/images/{quote(slug)}", missing=("image", slug))
    output = _format(output, as_json)
    if getattr(output, "value", output) in ("json", "yaml"):
        emit(doc, output)
        return
    emit(doc, output, fields=["slug", "status", "digest_sha256", "source_uri", ("image path", _image_path)])
    typer.echo("")
    emit(doc, output, rows=doc["nodes"], columns=CACHE_COLUMNS)


def _image_path(doc: dict[str, Any]) -> Any:
    return (doc.get("metadata") or {}).get("image_path")


@images_app.command("build")
def images_build(
    slug: Annotated[str, typer.Option("--slug", help="The catalog slug to build (it must exist).")],
    source: Annotated[Optional[Path], typer.Option("--source", help="Source qcow2 (or raw) image.")] = None,
    source_format: Annotated[
        str, typer.Option("--source-format", help="qcow2 | raw: how the source is opened (never probed).")
    ] = "qcow2",
    reuse_build: Annotated[
        Optional[str], typer.Option("--reuse-build", help="Republish this build's artifact.")
    ] = None,
    packages: Annotated[Optional[list[str]], typer.Option("--package", help="Package to install (repeatable).")] = None,
    customise: Annotated[Optional[str], typer.Option("--customise", help="stamp | virt-customize | none")] = None,
    tag: Annotated[Optional[str], typer.Option("--tag", help="Registry tag (default: UTC build time).")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the plan only.")] = False,
    no_catalog: Annotated[bool, typer.Option("--no-catalog", help="Publish without touching the catalog.")] = False,
    wait: Annotated[bool, typer.Option("--wait", help="Follow until active on every slice host.")] = False,
    timeout: Annotated[
        float,
        typer.Option("--timeout", min=0.1, help="Seconds to wait for each answer, and with --wait for the build."),
    ] = 600.0,
    nats_url: Annotated[
        Optional[str],
        typer.Option("--nats-url", help="Where --wait reads progress. Default: $GPUAAS_NATS_URL, else the stack's."),
    ] = None,
    creds: CredsOpt = None,
    run_dir: RunDirOpt = DEFAULT_RUN_DIR,
    admin_url: AdminUrlOpt = None,
    token: TokenOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Build (or republish), push to the registry, catalog, prewarm every slice host. With --wait, progress bars
    fed by the bus (read as ops, or as --creds).

    Example: gpuaas images build --slug debian-12-lab --package htop --wait"""
    ep = _endpoint(admin_url, token, run_dir, timeout)
    body = {
        "source": str(source.resolve()) if source else None,
        "source_format": source_format,
        "reuse_build_id": reuse_build,
        "packages": packages or [],
        "customise": customise,
        "tag": tag,
        "dry_run": dry_run,
        "update_catalog": not no_catalog,
    }
    identity = None
    if wait and not dry_run:
        info = read_stack_json(run_dir) or {}
        nats = nats_url or os.environ.get("GPUAAS_NATS_URL") or info.get("nats_url")
        try:
            identity = cli_identity(nats, creds, run_dir, "ops") if nats else None
        except FileNotFoundError as exc:
            raise fail(f"[red]{exc}[/]", EXIT_UNREACHABLE) from None
    result = asyncio.run(_build(ep, slug, body, wait and not dry_run, timeout, identity, as_json))
    if as_json:
        print(json.dumps(result, indent=2))
    raise typer.Exit(EXIT_TIMEOUT if result.get("timed_out") else 0 if result.get("ok", True) else EXIT_FAILED)


HostMode = choices("HostMode", ("build-and-upload", "build-only", "upload-only", "dry-run"))
HOST_UPLOAD_FIELDS: list[Column] = [
    "mode",
    ("slug", lambda d: (d.get("image") or {}).get("slug")),
    ("status", lambda d: (d.get("image") or {}).get("status")),
    "sha256",
    "size",
    ("tgz", lambda d: d.get("source_path")),
    "upload_sent",
    "operation_id",
]


@images_app.command("host-upload")
def images_host_upload(
    slug: Annotated[str, typer.Argument(help="The host image's catalog slug; MAAS names it custom/SLUG.")],
    rootfs: Annotated[
        Optional[Path], typer.Option("--rootfs", help="The prepared root tree to archive (not with upload-only).")
    ] = None,
    mode: Annotated[
        HostMode,  # type: ignore[valid-type]
        typer.Option(
            "--mode",
            help="build-and-upload: archive, catalog, upload; build-only: archive and catalog, no upload; "
            "upload-only: upload a tgz built before (checked against its sha256, no tree read); dry-run: check "
            "and say what would be done, write nothing.",
        ),
    ] = "build-and-upload",  # type: ignore[assignment]
    sha256: Annotated[
        Optional[str], typer.Option("--sha256", help="upload-only: the built tgz to send (default: the newest).")
    ] = None,
    site_bootstrap: Annotated[
        Optional[Path], typer.Option("--site-bootstrap", help="A site bootstrap script to put in the image.")
    ] = None,
    site: Annotated[Optional[str], typer.Option("--site", help="MAAS site (default: the pipeline's).")] = None,
    title: Annotated[Optional[str], typer.Option("--title", help="The boot resource's title in MAAS.")] = None,
    base_image: Annotated[
        Optional[str], typer.Option("--base-image", help="MAAS base image, e.g. ubuntu/noble.")
    ] = None,
    output: OutputOpt = "table",
    idempotency_key: IdempotencyOpt = None,
    run_dir: RunDirOpt = DEFAULT_RUN_DIR,
    admin_url: AdminUrlOpt = None,
    token: TokenOpt = None,
    timeout: Annotated[
        float, typer.Option("--timeout", min=0.1, help="Seconds to wait for the answer (a build archives the tree).")
    ] = 600.0,
) -> None:
    """Build a MAAS host image (a rootfs tgz with the curtin marker) and have the MAAS gateway upload it, or one of
    the two, or a dry run; follow the upload with `gpuaas images status SLUG -o yaml` (metadata.maas).

    Example: gpuaas images host-upload gpuaas-h200-host-ubuntu2404 --rootfs ./rootfs --mode build-only"""
    ep = _endpoint(admin_url, token, run_dir, timeout)
    given = {
        "mode": getattr(mode, "value", mode).replace("-", "_"),
        "rootfs": str(rootfs.resolve()) if rootfs else None,
        "site_bootstrap": str(site_bootstrap.resolve()) if site_bootstrap else None,
        "sha256": sha256,
        "site": site,
        "title": title,
        "base_image": base_image,
    }
    body = {k: v for k, v in given.items() if v is not None}
    doc = call(ep, "POST", f"/v1/images/{quote(slug)}/host-upload", body=body, key=idempotency_key,
               missing=("image", slug))  # fmt: skip
    if getattr(output, "value", output) in ("json", "yaml"):
        emit(doc, output)
        return
    if doc.get("plan"):
        plan = doc["plan"]
        emit(
            doc,
            output,
            fields=[
                "mode",
                ("slug", lambda d: slug),
                ("creates image", lambda d: d["plan"]["creates_image"]),
                ("entries", lambda d: d["plan"]["tree"]["entries"]),
                ("files", lambda d: d["plan"]["tree"]["files"]),
                ("tar bytes", lambda d: d["plan"]["tree"]["tar_bytes_estimate"]),
                ("tgz", lambda d: f"{d['plan']['tgz_dir']}/{d['plan']['tgz_name']}"),
                ("target", lambda d: f"{d['plan']['upload']['site']}/{d['plan']['upload']['name']}"),
            ],
        )
        for step in plan["steps"]:
            typer.echo(f"  would: {step}")
        return
    emit(doc, output, fields=HOST_UPLOAD_FIELDS)


async def _api(ep: Endpoint, method: str, path: str, **kw: Any) -> Any:
    # urllib blocks: on a thread, so the bus's progress keeps arriving meanwhile.
    return await asyncio.to_thread(call, ep, method, path, **kw)


async def _build(
    ep: Endpoint, slug: str, body: dict, wait: bool, timeout: float, identity: Any, as_json: bool
) -> dict[str, Any]:
    nc = None
    events: asyncio.Queue = asyncio.Queue()
    if wait and identity is not None:
        from .bus import connect

        # As ops: reads image events, writes nothing.
        nc = await connect(identity)

        async def on_msg(msg: Any) -> None:
            try:
                await events.put(json.loads(msg.data))
            except ValueError:
                pass

        # Subscribed before the build starts, so no progress is missed.
        await nc.subscribe("gpuaas.image.event.>", cb=on_msg)
        await nc.subscribe("gpuaas.node.*.report.image_cache", cb=on_msg)
    try:
        build = await _api(ep, "POST", f"/v1/images/{quote(slug)}/builds", body=body, missing=("image", slug))
        if body["dry_run"]:
            for step in build["plan"]["steps"]:
                err.print(f"  [cyan]plan[/] {step}")
            return {"build": build, "plan": build["plan"]}
        err.print(f"build {build['build_id']} of {slug} started -> {build['plan']['artifact_ref']}")
        if not wait:
            return {"build": build}
        return await _follow(ep, slug, build["build_id"], events, timeout, as_json)
    finally:
        if nc is not None:
            await nc.drain()


def _progress_event(progress: Progress, bar: Any, ev: dict[str, Any], slug: str, build_id: str) -> None:
    p, t = ev.get("payload", {}), ev.get("type")
    if t == "image.build_progress" and p.get("build_id") == build_id and p["phase"] in PHASES:
        progress.update(bar(p["phase"], p["bytes_total"]), completed=p["bytes_done"], total=max(p["bytes_total"], 1))
    elif t == "node.image_cache_reported" and p.get("slug") == slug:
        key = f"pull {p['node_id']}"
        done = p["bytes_total"] if p["status"] == "verified" else p["bytes_done"]
        progress.update(bar(key, p["bytes_total"]), completed=done, description=f"{key} [{p['status']}]")


async def _settled(ep: Endpoint, slug: str, build_id: str) -> Optional[dict[str, Any]]:
    """The build's outcome once there is one: failed, active with its digest, or a cache that refused it."""
    build = await _api(ep, "GET", f"/v1/builds/{quote(build_id)}", missing=("build", build_id))
    if build["status"] == "failed":
        err.print(f"[red]build failed[/]: {build['error']}")
        return {"ok": False, "build": build}
    if build["status"] != "published":
        return None
    image = await _api(ep, "GET", f"/v1/images/{quote(slug)}", missing=("image", slug))
    if image["status"] == "active" and image["digest_sha256"] == build["raw_sha256"]:
        err.print(f"[green]{slug} active[/] with digest {image['digest_sha256']}")
        return {"ok": True, "build": build, "image": image}
    bad = [
        n["node_id"]
        for n in image["nodes"]
        if n["status"] in ("mismatch", "failed") and n["expected_digest"] == build["raw_sha256"]
    ]
    if bad:
        err.print(f"[red]{slug} not active[/]: cache not verified on {', '.join(bad)}")
        return {"ok": False, "build": build, "image": image}
    return None


async def _follow(
    ep: Endpoint, slug: str, build_id: str, events: asyncio.Queue, timeout: float, as_json: bool
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
                _progress_event(progress, bar, ev, slug, build_id)
            if time.monotonic() >= next_poll:
                next_poll = time.monotonic() + 1.0
                outcome = await _settled(ep, slug, build_id)
                if outcome is not None:
                    return outcome
    err.print(f"[red]build {build_id} of {slug} not active within {timeout:g}s[/]")
    return {"ok": False, "timed_out": True, "build_id": build_id}
