"""MAAS host images: catalog a built rootfs tgz, ask the MAAS gateway to upload it as boot resource
custom/<slug>, record the boot-resource id from the gateway's result, and switch site profiles to it
(and back). Each function works in the caller's unit of work; commands leave through its outbox, so a
crash between the catalog change and the command loses neither.

The catalog keeps the upload state in the image's `maas` metadata (protected from PATCH: only the
gateway's result may set a boot-resource id); every request is also a `maas_requests` row keyed by the
gateway operation id.
"""

from __future__ import annotations

import uuid
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from gpuaas_common.contract import messages as m
from gpuaas_common.logging import get_logger

from ..adapters.host_image import HostImage
from ..domain.catalog import (
    HostUploadRequest,
    ImageCreate,
    ProfileImageRequest,
    mark_host_build_uploading,
    pick_host_build,
    record_host_build,
)
from . import catalog
from .catalog import CatalogError, Uow
from .ports import Row

log = get_logger(__name__)


def request_dict(row: Row) -> dict[str, Any]:
    d = dict(row)
    for k in ("created_at", "updated_at"):
        d[k] = d[k].isoformat()
    return d


async def _host_row(uow: Uow, slug: str, req: HostUploadRequest, cache_dir: str, *, create: bool) -> Row:
    """The image's row, locked; a new slug gets one (disabled) when `create`, else it is a 404."""
    row = await uow.repos.images.lock(slug)
    if row is None:
        if not create:
            raise CatalogError(404, "not_found", f"no image {slug}")
        row = await catalog.create_image(
            uow,
            ImageCreate(slug=slug, kind="host", compatible_sku=req.compatible_sku, driver_strategy=req.driver_strategy),
            cache_dir,
        )
    if row["kind"] != "host":
        raise CatalogError(409, "not_a_host_image", f"{slug} is a {row['kind']} image")
    return row


async def record_build(uow: Uow, slug: str, req: HostUploadRequest, built: HostImage, cache_dir: str) -> Row:
    """Catalog a built tgz under the image's `host_builds` (status `built`: on disk, not sent to MAAS). Nothing
    else of the row changes: what MAAS holds and what deploys stay as they were until an upload."""
    row = await _host_row(uow, slug, req, cache_dir, create=True)
    meta = catalog._meta(row)
    entry = {
        "sha256": built.sha256,
        "size": built.size,
        "source_path": str(built.path),
        "built_at": datetime.now(timezone.utc).isoformat(),
        "status": "built",
        "operation_id": None,
    }
    meta["host_builds"] = record_host_build(meta.get("host_builds") or [], entry)
    await uow.repos.images.update(slug, metadata=meta)
    log.info("host_image_build_recorded", slug=slug, sha256=built.sha256, size=built.size)
    return await uow.repos.images.lock(slug)  # type: ignore[return-value]


async def built_tgz(uow: Uow, slug: str, req: HostUploadRequest) -> HostImage:
    """The built tgz upload_only sends (req.sha256, else the newest), as catalogued; 404/409 when there is none.
    The caller checks the file still holds those bytes before sending it."""
    row = await _host_row(uow, slug, req, "", create=False)
    builds = catalog._meta(row).get("host_builds") or []
    found = pick_host_build(builds, req.sha256)
    if found is None:
        which = f"tgz {req.sha256}" if req.sha256 else "tgz"
        raise CatalogError(
            409,
            "not_built",
            f"{slug} has no built {which} to upload: build it first (mode build_only or build_and_upload)",
            {"built": [b["sha256"] for b in builds]},
        )
    return HostImage(Path(found["source_path"]), found["sha256"], found["size"])


async def request_upload(
    uow: Uow, slug: str, req: HostUploadRequest, built: HostImage, site: str, cache_dir: str
) -> tuple[Row, str, bool]:
    """Send the upload command for a catalogued tgz (`record_build` first). Returns (image row, operation id,
    sent): the same content already uploaded or on its way to the same site sends nothing (a reproducible
    rebuild must not upload again)."""
    row = await _host_row(uow, slug, req, cache_dir, create=True)
    meta = catalog._meta(row)
    meta.setdefault("host_builds", [])
    current = meta.get("maas") or {}
    if (
        current.get("sha256") == built.sha256
        and current.get("site") == site
        and current.get("status") in ("uploading", "uploaded")
    ):
        meta["host_builds"] = mark_host_build_uploading(meta["host_builds"], built.sha256, current["operation_id"])
        await uow.repos.images.update(slug, metadata=meta)
        return await uow.repos.images.lock(slug), current["operation_id"], False  # type: ignore[return-value]

    op_id = str(uuid.uuid4())
    cmd = m.MaasImageUploadRequested(
        operation_id=op_id,
        site=site,
        name=slug,
        title=req.title,
        architecture=req.architecture,
        filetype="tgz",
        base_image=req.base_image,
        source_path=str(built.path),
        sha256=built.sha256,
        size=built.size,
    )
    await uow.repos.maas_requests.insert(op_id, slug, "upload_image", site, cmd.model_dump(mode="json"))
    meta["maas"] = {
        "site": site,
        "name": f"custom/{slug}",
        "architecture": req.architecture,
        "filetype": "tgz",
        "operation_id": op_id,
        "status": "uploading",
        "source_path": str(built.path),
        "sha256": built.sha256,
        "size": built.size,
        "boot_resource_id": None,
        "profiles": current.get("profiles", {}),
    }
    meta["host_builds"] = mark_host_build_uploading(meta["host_builds"], built.sha256, op_id)
    new_digest = row["digest_sha256"] != built.sha256
    # New bytes are not deployable until MAAS holds them complete: an active image with another digest
    # stops being offered until an operator enables the uploaded one.
    status = "building" if new_digest or row["status"] == "disabled" else row["status"]
    if row["status"] == "active" and status != "active":
        await catalog.emit_deactivated(uow, slug, f"new host image {built.sha256} is being uploaded to MAAS")
    await uow.repos.images.update(slug, digest_sha256=built.sha256, metadata=meta, status=status)
    await uow.events.add("maas.image_upload_requested", cmd, aggregate_id=f"image:{slug}")
    log.info("host_image_upload_requested", slug=slug, operation_id=op_id, sha256=built.sha256, size=built.size)
    return await uow.repos.images.lock(slug), op_id, True  # type: ignore[return-value]


async def request_profile_image(uow: Uow, slug: str, req: ProfileImageRequest, default_site: str) -> str:
    row = await uow.repos.images.lock(slug)
    if row is None:
        raise CatalogError(404, "not_found", f"no image {slug}")
    if row["kind"] != "host":
        raise CatalogError(409, "not_a_host_image", f"{slug} is a {row['kind']} image")
    maas = catalog._meta(row).get("maas") or {}
    site = req.site or maas.get("site") or default_site
    series = req.distro_series
    if series is None:
        # Selecting this image only makes sense once MAAS holds it complete at that site.
        if maas.get("status") != "uploaded" or maas.get("site") != site:
            raise CatalogError(409, "not_uploaded", f"{slug} is not uploaded to MAAS site {site}")
        series = f"custom/{slug}"
    op_id = str(uuid.uuid4())
    cmd = m.MaasProfileImageSetRequested(operation_id=op_id, site=site, profile=req.profile, distro_series=series)
    await uow.repos.maas_requests.insert(
        op_id, slug, "set_distro_series", site, cmd.model_dump(mode="json"), profile=req.profile
    )
    await uow.events.add("maas.profile_image_set_requested", cmd, aggregate_id=f"image:{slug}")
    log.info(
        "profile_image_set_requested",
        slug=slug,
        site=site,
        profile=req.profile,
        distro_series=series,
        operation_id=op_id,
    )
    return op_id


async def _claim_request(uow: Uow, ev: m.MaasLifecycleResult) -> Row | None:
    """The open request this result answers, now closed; None for someone else's operation or a result
    already applied."""
    req = await uow.repos.maas_requests.lock(ev.operation_id)
    if req is None or req["status"] != "requested":
        return None
    await uow.repos.maas_requests.close(ev.operation_id, ev.status, ev.model_dump(mode="json"))
    return req


async def on_upload_result(uow: Uow, ev: m.MaasImageUploadResult) -> None:
    req = await _claim_request(uow, ev)
    if req is None:
        log.info("upload_result_not_ours", operation_id=ev.operation_id)
        return
    row = await uow.repos.images.lock(req["slug"])
    meta = catalog._meta(row) if row is not None else {}
    maas = meta.get("maas") or {}
    if row is None or maas.get("operation_id") != ev.operation_id:
        # A newer upload superseded this one; its own result decides the catalog.
        log.info("upload_result_superseded", slug=req["slug"], operation_id=ev.operation_id)
        return
    ok = ev.status == "succeeded" and ev.boot_resource_id is not None
    reason, message = ev.reason_code, ev.status_message
    if ok and (ev.sha256 != maas["sha256"] or ev.size != maas["size"]):
        # Never record a boot resource for bytes other than the ones catalogued.
        ok, reason, message = False, "digest_mismatch", f"MAAS holds {ev.sha256} ({ev.size} B)"
    maas.update(
        status="uploaded" if ok else "failed",
        boot_resource_id=ev.boot_resource_id if ok else None,
        reason_code=None if ok else reason,
        status_message=None if ok else message,
    )
    meta["maas"] = maas
    # Only a row this upload put in `building` moves: uploaded = published (deployable once an operator
    # enables it, which announces image.activated), failed = disabled. Same bytes sent to another site
    # leave an active image active, so no status change ever bypasses image.deactivated.
    status = row["status"]
    if status == "building":
        status = "published" if ok else "disabled"
    await uow.repos.images.update(row["slug"], metadata=meta, status=status)
    log.info(
        "host_image_uploaded" if ok else "host_image_upload_failed",
        slug=row["slug"],
        boot_resource_id=ev.boot_resource_id,
        reason_code=reason,
    )


async def on_profile_image_result(uow: Uow, ev: m.MaasProfileImageSetResult) -> None:
    req = await _claim_request(uow, ev)
    if req is None:
        log.info("profile_result_not_ours", operation_id=ev.operation_id)
        return
    row = await uow.repos.images.lock(req["slug"])
    if row is None:
        return
    meta = catalog._meta(row)
    maas = meta.setdefault("maas", {})
    profiles = maas.setdefault("profiles", {})
    key = f"{req['site']}/{req['profile']}"
    if ev.status == "succeeded":
        # What the profile deploys now, in MAAS' own namespace: custom/<slug> while it uses this image.
        profiles[key] = {
            "distro_series": ev.deploy_distro_series or ev.distro_series,
            "previous_distro_series": ev.previous_distro_series,
            "operation_id": ev.operation_id,
            "uses_this_image": (ev.deploy_distro_series or "") == f"custom/{row['slug']}",
        }
    await uow.repos.images.update(row["slug"], metadata=meta)
    log.info(
        "profile_image_result",
        slug=row["slug"],
        profile=key,
        status=ev.status,
        distro_series=ev.deploy_distro_series,
        reason_code=ev.reason_code,
    )
