"""Upload a host image to a site as a custom boot resource: create it by sha256 and size, PUT the file
in chunks, resume from what MAAS shows."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
from dataclasses import dataclass
from functools import partial
from typing import Any

from gpuaas_common.logging import get_logger

from ..adapters.maas_errors import MaasError, MaasUnreachable
from ..domain.operations import image_name
from .metrics import MAAS_CALLS, UNKNOWN_OUTCOMES
from .ports import GatewayRepositories, Row
from .shared import Operations, Site, Unresolvable, as_dict, now, params

log = get_logger(__name__)


@dataclass(frozen=True)
class _Upload:
    """One step's view of an upload: the operation, the file (hashed once, its digest kept in the progress)
    and the boot resource it becomes."""

    ops: Operations
    site: Site
    row: Row
    params: dict[str, Any]
    progress: dict[str, Any]
    name: str
    arch: str
    path: str

    @property
    def op_id(self) -> str:
        return str(self.row["operation_id"])

    @property
    def digest(self) -> str:
        return str(self.progress["sha256"])

    @property
    def size(self) -> int:
        return int(self.progress["size"])

    @property
    def filetype(self) -> str:
        return str(self.params.get("filetype") or "tgz")


async def step(ops: Operations, site: Site, row: Row) -> None:
    """Every step starts from what MAAS shows: a resource with our sha256 that is complete means done
    (even if the answer to the last chunk was lost); an incomplete one is resumed at the byte offset its
    progress reports; none means the create has to be (re)sent, but only once a lost create has had its
    grace period to show up.
    """
    upload = await _hashed(ops, site, row)
    try:
        found = await _find_resource_file(ops, site, upload.name, upload.arch, upload.digest)
        if found is None:
            if _lost_create_may_still_show(upload):
                await ops.set(upload.op_id, delay=ops.settings.maas_poll_interval_s)
                return
            found = await _create(upload)
        await _send_chunks(upload, found)
        found = await _find_resource_file(ops, site, upload.name, upload.arch, upload.digest)
    except MaasError as exc:
        await _after_maas_error(upload, exc)
        return
    if found is None or not found[1].get("complete"):
        # MAAS did not take every byte (e.g. a chunk answer lost in a way we could not see): look again.
        await ops.set(
            upload.op_id,
            state="unknown",
            unknown_since=row["unknown_since"] or now(),
            resolution="polled",
            delay=ops.settings.maas_poll_interval_s,
        )
        return
    await _record(upload, found[0])


async def _hashed(ops: Operations, site: Site, row: Row) -> _Upload:
    """The upload, its file's size and sha256 read once and kept in the progress: later steps trust them."""
    p = params(row)
    progress = as_dict(row["progress"])
    name, arch = image_name(p["name"]), p.get("architecture") or "amd64/generic"
    path = p["source_path"]
    if "sha256" not in progress:
        try:
            size, digest = await asyncio.to_thread(_size_and_sha256, path, ops.settings.maas_upload_chunk_bytes)
        except OSError as exc:
            raise Unresolvable("source_unreadable", f"cannot read the image: {exc.strerror}") from None
        if (p.get("sha256") and p["sha256"] != digest) or (p.get("size") and p["size"] != size):
            raise Unresolvable("checksum_mismatch", "the image file does not match the given sha256/size")
        progress = {**progress, "sha256": digest, "size": size}
        await ops.set(row["operation_id"], delay=0, progress=json.dumps(progress))
    return _Upload(ops, site, row, p, progress, name, arch, path)


def _lost_create_may_still_show(upload: _Upload) -> bool:
    """A create whose answer was lost may still appear in MAAS's listing: until its grace period is over,
    sending it again could make a second resource."""
    row = upload.row
    untouched = (now() - row["unknown_since"]).total_seconds() if row["unknown_since"] else None
    return bool(row["state"] == "unknown" and (untouched is None or untouched < upload.ops.settings.maas_grace_s))


async def _create(upload: _Upload) -> tuple[int, dict[str, Any]]:
    """Send the create, counted before it goes: from here a lost answer is an unknown outcome."""
    ops, site, p = upload.ops, upload.site, upload.params
    await ops.set(upload.op_id, state="submitting", delay=0, maas_calls=upload.row["maas_calls"] + 1)
    MAAS_CALLS.labels("upload_image").inc()
    created = await ops.maas(
        site,
        lambda: site.client.create_boot_resource(
            f"custom/{upload.name}",
            upload.arch,
            upload.digest,
            upload.size,
            title=p.get("title") or "",
            filetype=upload.filetype,
            base_image=p.get("base_image") or None,
        ),
    )
    found = file_in(created, upload.digest)
    if found is None:
        raise Unresolvable("maas_unexpected", "MAAS created the resource without our file")
    return found


async def _send_chunks(upload: _Upload, found: tuple[int, dict[str, Any]]) -> None:
    """PUT the bytes MAAS does not have yet, from the offset its progress shows, recording each chunk sent."""
    ops, site, size = upload.ops, upload.site, upload.size
    await ops.set(upload.op_id, state="accepted", delay=0)
    _, rfile = found
    offset = 0 if rfile.get("complete") else round(float(rfile.get("progress") or 0.0) * size / 100.0)
    chunk_size = ops.settings.maas_upload_chunk_bytes
    while not rfile.get("complete") and offset < size:
        chunk = await asyncio.to_thread(_read_at, upload.path, offset, chunk_size)
        if not chunk:
            raise Unresolvable("source_unreadable", "the image file shrank during the upload")
        MAAS_CALLS.labels("upload_image").inc()
        await ops.maas(site, partial(site.client.upload_chunk, rfile["upload_uri"], chunk))
        offset += len(chunk)
        await ops.set(upload.op_id, delay=0, progress=json.dumps({**upload.progress, "uploaded": offset}))


async def _after_maas_error(upload: _Upload, exc: MaasError) -> None:
    """Unreachable: try again later, as unknown once a call may have gone out. A lost answer or a MAAS that
    asks us to wait: poll. Any other refusal fails the operation."""
    ops, row = upload.ops, upload.row
    if isinstance(exc, MaasUnreachable):
        await ops.set(
            upload.op_id,
            state="unknown" if row["maas_calls"] else "pending",
            last_error=str(exc)[:500],
            delay=ops.settings.maas_poll_interval_s,
        )
        return
    if exc.outcome_unknown or exc.retry_after is not None:
        if exc.outcome_unknown:
            UNKNOWN_OUTCOMES.labels("upload_image").inc()
        await ops.set(
            upload.op_id,
            state="unknown",
            resolution="polled",
            unknown_since=now(),
            last_error=str(exc)[:500],
            delay=ops.retry_delay(exc),
        )
        return
    reason = "checksum_mismatch" if "SHA256" in exc.body else f"maas_http_{exc.status}"
    await ops.finish(row, "failed", reason_code=reason, message=exc.body[:500])


async def _record(upload: _Upload, resource_id: int) -> None:
    """The file is complete in MAAS: the catalog learns the boot resource in the same commit as the finish."""
    row, name, digest, size = upload.row, upload.name, upload.digest, upload.size

    async def record(repos: GatewayRepositories) -> None:
        await repos.catalog.record_boot_resource(
            site=row["site"],
            name=name,
            architecture=upload.arch,
            boot_resource_id=resource_id,
            filetype=upload.filetype,
            sha256=digest,
            size=size,
            operation_id=upload.op_id,
        )

    log.info("boot_resource_uploaded", boot_resource_id=resource_id, image=name, size=size)
    await upload.ops.finish(
        row,
        "succeeded",
        during=record,
        result={"name": f"custom/{name}", "boot_resource_id": resource_id, "sha256": digest, "size": size},
    )


async def _find_resource_file(
    ops: Operations, site: Site, name: str, arch: str, digest: str
) -> tuple[int, dict[str, Any]] | None:
    listed = await ops.maas(site, site.client.list_boot_resources)
    for item in listed:
        if image_name(item.get("name", "")) == name and item.get("architecture") == arch:
            full = await ops.maas(site, partial(site.client.read_boot_resource, item["id"]))
            found = file_in(full, digest)
            if found is not None:
                return found
    return None


def file_in(resource: dict[str, Any], digest: str) -> tuple[int, dict[str, Any]] | None:
    """The newest file of a boot resource with this sha256: complete if any is, else the newest."""
    best: dict[str, Any] | None = None
    for version in sorted(resource.get("sets") or {}):
        for rfile in (resource["sets"][version].get("files") or {}).values():
            if rfile.get("sha256") == digest and (best is None or not best.get("complete")):
                best = rfile
    return (int(resource["id"]), best) if best is not None else None


def _size_and_sha256(path: str, chunk: int) -> tuple[int, str]:
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
            size += len(block)
    return size, digest.hexdigest()


def _read_at(path: str, offset: int, length: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(offset, os.SEEK_SET)
        return f.read(length)
