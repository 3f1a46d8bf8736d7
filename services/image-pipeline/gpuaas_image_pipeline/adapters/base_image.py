"""The vendor base image a build starts from: downloaded from a URL, checked against the vendor's published
checksum list (`SHA256SUMS`: `<hex>  <name>` per line, as Debian and Ubuntu publish them), kept in a cache
keyed by digest.

A cache entry exists only once its content matched the list: the download goes to a `.part` file that is
renamed after the check, and removed whatever happens otherwise.
"""

from __future__ import annotations

import asyncio
import hashlib
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlsplit

import aiohttp

from .qemu import ImageToolError, _run

Progress = Callable[[int, int], None]
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
CHUNK = 1 << 20


class BaseImageError(ImageToolError):
    """One line, starting with a reason code: base_download_failed, base_not_in_checksums,
    base_checksum_mismatch."""


@dataclass(frozen=True)
class BaseImage:
    path: Path
    sha256: str
    name: str
    # False when the cache already held this digest and it re-hashed to it.
    downloaded: bool


def image_name(url: str) -> str:
    name = unquote(urlsplit(url).path.rsplit("/", 1)[-1])
    if not name:
        raise BaseImageError(f"base_download_failed: {url} names no file")
    return name


def parse_sums(text: str) -> dict[str, str]:
    """name -> digest; `*name` (binary mode) counts as `name`, malformed lines are ignored."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        parts = line.strip().split(None, 1)
        if len(parts) == 2 and _HEX64.match(parts[0].lower()):
            out[parts[1].lstrip("*")] = parts[0].lower()
    return out


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


async def fetch_base_image(
    url: str,
    checksums_url: str,
    cache_dir: Path,
    *,
    progress: Progress | None = None,
    timeout_s: float = 3600.0,
) -> BaseImage:
    name = image_name(url)
    timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=30, sock_read=120)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        sums = parse_sums(await _get_text(http, checksums_url))
        want = sums.get(name)
        if want is None:
            raise BaseImageError(f"base_not_in_checksums: {name} is not listed in {checksums_url}")
        await asyncio.to_thread(cache_dir.mkdir, parents=True, exist_ok=True)
        suffix = Path(name).suffix
        entry = cache_dir / f"sha256-{want}{suffix}"
        if await asyncio.to_thread(entry.is_file):
            # Re-hashed, not trusted: a cache entry damaged on disk must not become an image.
            if await asyncio.to_thread(_sha256, entry) == want:
                return BaseImage(entry, want, name, downloaded=False)
            await asyncio.to_thread(entry.unlink)
        part = cache_dir / f"sha256-{want}.{uuid.uuid4().hex[:8]}.part"
        try:
            got = await _download(http, url, part, progress)
            if got != want:
                raise BaseImageError(
                    f"base_checksum_mismatch: {name} from {url} has sha256 {got}, {checksums_url} says {want}"
                )
            await asyncio.to_thread(part.replace, entry)
        finally:
            await asyncio.to_thread(part.unlink, missing_ok=True)
    return BaseImage(entry, want, name, downloaded=True)


async def _get_text(http: aiohttp.ClientSession, url: str) -> str:
    try:
        async with http.get(url) as resp:
            if resp.status != 200:
                raise BaseImageError(f"base_download_failed: {url} answered HTTP {resp.status}")
            return await resp.text()
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise BaseImageError(f"base_download_failed: {url}: {type(exc).__name__}: {exc}") from None


async def _download(http: aiohttp.ClientSession, url: str, dst: Path, progress: Progress | None) -> str:
    h = hashlib.sha256()
    try:
        async with http.get(url) as resp:
            if resp.status != 200:
                raise BaseImageError(f"base_download_failed: {url} answered HTTP {resp.status}")
            total = resp.content_length or 0
            done = 0
            with dst.open("wb") as f:
                async for chunk in resp.content.iter_chunked(CHUNK):
                    h.update(chunk)
                    await asyncio.to_thread(f.write, chunk)
                    done += len(chunk)
                    if progress:
                        progress(done, max(total, done))
            if total and done != total:
                raise BaseImageError(f"base_download_failed: {url} ended after {done} of {total} bytes")
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise BaseImageError(f"base_download_failed: {url}: {type(exc).__name__}: {exc}") from None
    return h.hexdigest()


async def resize(image: Path, fmt: str, gib: int) -> None:
    """Grow the virtual disk. The partitions stay as they are: the guest's cloud-init grows its root into the
    space (growpart, from cloud-guest-utils). qemu-img refuses to shrink, which would cut a filesystem."""
    await _run("qemu-img", "resize", "-f", fmt, str(image), f"{gib}G")
