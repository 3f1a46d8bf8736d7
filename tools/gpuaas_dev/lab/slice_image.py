"""The lab's slice guest image, made by the image pipeline's own build steps.

The lab base (Debian 12 from Debian packages, `base_image.py`) is served over loopback with its SHA256SUMS,
as the runbook's Ubuntu cloud image is served by its publisher; the pipeline's fetch verifies and caches it, its
chroot customiser installs the guest packages (cloud-init, openssh-server, qemu-guest-agent) and the readiness
unit, the package database is read back from the artifact, and the raw is hashed. Built once per input: the
result is cached under a key of the base digest, the package list and this module's version, so `make test`
reuses an unchanged image. Publishing to the registry and the catalog is the pipeline service's part; the dev
stack's `--lab` runs that (the e2e lab test puts the artifact in the host's cache as a prewarm would).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from gpuaas_common.digests import sha256_file
from gpuaas_common.logging import get_logger
from gpuaas_image_pipeline.adapters import qemu
from gpuaas_image_pipeline.adapters.base_image import FetchPolicy, fetch_base_image
from gpuaas_image_pipeline.adapters.customise_chroot import (
    READY_UNIT_TEXT,
    ChrootCustomiser,
    gpu_report_source,
    installed_versions,
)

from .base_image import default_cache_dir, ensure_base_image, serve_directory

log = get_logger(__name__)

SLICE_IMAGE_VERSION = "2"
SLUG = "debian-12-lab-slice"
PACKAGES = ("cloud-init", "openssh-server", "qemu-guest-agent")


@dataclass(frozen=True)
class SliceImage:
    slug: str
    path: Path  # sparse raw
    sha256: str
    packages: dict[str, str]  # name -> version, read back from the artifact
    built: bool  # False when the cache had it
    seconds: dict[str, float]


async def ensure_slice_image(cache_dir: Path | None = None) -> SliceImage:
    cache = Path(cache_dir) if cache_dir else default_cache_dir()
    timings: dict[str, float] = {}
    t = time.monotonic()
    base = await ensure_base_image(cache)
    timings["base"] = round(time.monotonic() - t, 2)
    # The guest files the customiser installs are part of the input: a changed readiness unit or GPU report means
    # a new image, never a cached one without it.
    guest = hashlib.sha256((READY_UNIT_TEXT + gpu_report_source()).encode()).hexdigest()
    key = hashlib.sha256(
        json.dumps(
            {"base": base.sha256, "packages": sorted(PACKAGES), "v": SLICE_IMAGE_VERSION, "guest": guest}
        ).encode()
    ).hexdigest()[:24]
    entry = cache / "slice" / key
    done = entry / "image.json"
    if done.exists():
        meta = json.loads(done.read_text())
        raw = entry / f"{SLUG}.raw"
        return SliceImage(meta["slug"], raw, meta["sha256"], meta["packages"], False, timings)

    work = cache / "slice" / f".{key}.{uuid.uuid4().hex[:8]}"
    work.mkdir(parents=True)
    try:
        url, stop = serve_directory(base.path.parent)
        try:
            t = time.monotonic()
            # The lab's own base over loopback: the one base the pipeline takes unsigned over plain http.
            fetched = await fetch_base_image(
                url + base.path.name, url + "SHA256SUMS", cache / "fetched", policy=FetchPolicy(loopback_lab=True)
            )
            timings["fetch_verify"] = round(time.monotonic() - t, 2)
        finally:
            stop()
        qcow = work / "work.qcow2"
        await qemu.convert_to_qcow2(fetched.path, "qcow2", qcow)
        t = time.monotonic()
        stamp = {"slug": SLUG, "base_sha256": base.sha256, "lab": True}
        await ChrootCustomiser().customise(qcow, list(PACKAGES), stamp)
        timings["customise"] = round(time.monotonic() - t, 2)
        raw = work / f"{SLUG}.raw"
        t = time.monotonic()
        await qemu.convert_to_raw(qcow, "qcow2", raw)
        qcow.unlink()
        versions = await installed_versions(raw, list(PACKAGES), work)
        digest = await asyncio.to_thread(sha256_file, raw)
        timings["convert_verify_hash"] = round(time.monotonic() - t, 2)
        (work / "image.json").write_text(json.dumps({"slug": SLUG, "sha256": digest, "packages": versions}))
        entry.parent.mkdir(parents=True, exist_ok=True)
        if entry.exists():  # another build got there first; its bytes are as good
            shutil.rmtree(work)
        else:
            work.rename(entry)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    log.info("lab_slice_image_built", sha256=digest, packages=versions, seconds=timings)
    await asyncio.to_thread(
        lambda: prune_stale(cache, base_entry=base.path.parent.name, base_sha256=base.sha256, slice_key=key)
    )
    meta = json.loads(done.read_text())
    return SliceImage(SLUG, entry / f"{SLUG}.raw", meta["sha256"], meta["packages"], True, timings)


async def prewarm(image: SliceImage, cache_dir: Path) -> Path:
    """Put the image in a host's cache at `<cache_dir>/<slug>.raw` (sparse) and re-hash it there: it counts as
    verified only when its bytes hash to the catalog digest, as the agent's prewarm checks."""
    await asyncio.to_thread(cache_dir.mkdir, parents=True, exist_ok=True)
    target = cache_dir / f"{image.slug}.raw"
    part = target.with_name(target.name + ".part")
    proc = await asyncio.create_subprocess_exec("cp", "--sparse=always", str(image.path), str(part))
    if await proc.wait() != 0:
        raise RuntimeError(f"copying {image.path} into the host cache failed")
    got = await asyncio.to_thread(sha256_file, part)
    if got != image.sha256:
        part.unlink()
        raise RuntimeError(f"prewarmed copy hashes to {got}, the image is {image.sha256}")
    part.replace(target)
    return target


def prune_stale(cache: Path, *, base_entry: str, base_sha256: str, slice_key: str) -> list[Path]:
    """After a build, the images of older recipes are of no use to anyone: each is hundreds of MB, and a machine
    that runs `make test` for months would otherwise keep every one. Entries being written (dot-names) stay."""
    stale: list[Path] = []
    for entry in cache.iterdir() if cache.is_dir() else ():
        if entry.is_dir() and len(entry.name) == 24 and entry.name != base_entry and not entry.name.startswith("."):
            stale.append(entry)  # a base recipe directory (base_image.recipe_hash names them)
    for entry in (cache / "slice").iterdir() if (cache / "slice").is_dir() else ():
        if entry.name != slice_key and not entry.name.startswith("."):
            stale.append(entry)
    for entry in (cache / "fetched").iterdir() if (cache / "fetched").is_dir() else ():
        if entry.name.startswith("sha256-") and base_sha256 not in entry.name and not entry.name.endswith(".part"):
            stale.append(entry)
    for entry in stale:
        if entry.is_dir():
            shutil.rmtree(entry)
        else:
            entry.unlink()
    return stale
