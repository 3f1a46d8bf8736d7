"""The vendor base image a build starts from: downloaded from a URL, checked against the vendor's published
checksum list (`SHA256SUMS`: `<hex>  <name>` per line, as Debian and Ubuntu publish them) or against a digest
pinned in the request, kept in a cache keyed by digest.

A checksum list proves something only when it is signed: it is fetched with its detached signature
(`SHA256SUMS.gpg`, as Ubuntu's cloud images publish it) and checked with gpgv against the configured keyring.
URLs are https; the lab's loopback base (plain http, unsigned list) is the one exception, allowed only by its
own setting (FetchPolicy.loopback_lab) and only for a loopback host.

A cache entry exists only once its content matched the list: the download goes to a `.part` file that is
renamed after the check, and removed whatever happens otherwise.
"""

from __future__ import annotations

import asyncio
import hashlib
import re
import tempfile
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlsplit

import aiohttp

from ..domain.catalog import is_loopback_url, url_refusal
from .qemu import ImageToolError, _run, tool_env

Progress = Callable[[int, int], None]
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
CHUNK = 1 << 20


class BaseImageError(ImageToolError):
    """One line, starting with a reason code: base_download_failed, base_not_in_checksums,
    base_checksum_mismatch, base_url_refused, base_unsigned, base_signature_bad."""


@dataclass(frozen=True)
class FetchPolicy:
    """What a fetch trusts. keyring: the OpenPGP keyring (gpgv --keyring) a checksum list's signature must
    verify against; None: only a pinned digest is trusted (or the lab's loopback base). loopback_lab: plain
    http and an unsigned list are taken from a loopback host, for the lab, which serves its base image from
    this machine."""

    keyring: Path | None = None
    loopback_lab: bool = False

    def __post_init__(self) -> None:
        if self.keyring is not None:
            object.__setattr__(self, "keyring", self.keyring.absolute())


STRICT = FetchPolicy()
SIGNATURE_SUFFIX = ".gpg"


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
    checksums_url: str | None,
    cache_dir: Path,
    *,
    pinned_sha256: str | None = None,
    policy: FetchPolicy = STRICT,
    progress: Progress | None = None,
    timeout_s: float = 3600.0,
) -> BaseImage:
    """The base image, once its digest matched what is trusted: the pinned digest, and the signed list's
    entry when a list is named (both, when both are given). Nothing is downloaded before that is settled."""
    name = image_name(url)
    for u in (url, checksums_url):
        if u is not None and (why := url_refusal(u, loopback_http=policy.loopback_lab)):
            raise BaseImageError(f"base_url_refused: {why}")
    if checksums_url is None and pinned_sha256 is None:
        raise BaseImageError(f"base_unsigned: {url} comes with neither a checksum list nor a pinned sha256")
    if checksums_url is not None and pinned_sha256 is None:
        _signature_checkable(checksums_url, policy)  # refused before anything is fetched
    timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=30, sock_read=120)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        want = pinned_sha256
        if checksums_url is not None:
            text = await _get_text(http, checksums_url, policy)
            await _check_signed(http, checksums_url, text, policy)
            listed = parse_sums(text).get(name)
            if listed is None:
                raise BaseImageError(f"base_not_in_checksums: {name} is not listed in {checksums_url}")
            if want is not None and listed != want:
                raise BaseImageError(
                    f"base_checksum_mismatch: {checksums_url} lists {name} as {listed}, the request pins {want}"
                )
            want = listed
        assert want is not None
        source = checksums_url or "the pinned sha256"
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
            got = await _download(http, url, part, progress, policy)
            if got != want:
                raise BaseImageError(
                    f"base_checksum_mismatch: {name} from {url} has sha256 {got}, {source} says {want}"
                )
            await asyncio.to_thread(part.replace, entry)
        finally:
            await asyncio.to_thread(part.unlink, missing_ok=True)
    return BaseImage(entry, want, name, downloaded=True)


def _after_redirects(resp: aiohttp.ClientResponse, policy: FetchPolicy) -> None:
    """A redirect may not lead an https fetch to plain http (or anywhere the request itself could not name)."""
    if why := url_refusal(str(resp.url), loopback_http=policy.loopback_lab):
        raise BaseImageError(f"base_url_refused: redirected: {why}")


def _signature_checkable(checksums_url: str, policy: FetchPolicy) -> bool:
    """Whether the list's signature is to be checked (False: the lab's loopback base); base_unsigned when it
    would have to be and no keyring is configured."""
    if policy.keyring is not None:
        return True
    if policy.loopback_lab and is_loopback_url(checksums_url):
        return False  # the lab's own base, served from this machine: nothing between it and us to sign against
    raise BaseImageError(
        f"base_unsigned: no keyring is configured (GPUAAS_IMAGE_BASE_KEYRING) to check {checksums_url}; "
        "pin the image's sha256 in the request instead"
    )


async def _check_signed(http: aiohttp.ClientSession, checksums_url: str, text: str, policy: FetchPolicy) -> None:
    if policy.keyring is None:
        # Nothing to check it against: the pinned digest settles it (the list must agree with it), or it is the
        # lab's loopback base; anything else was refused before the fetch (_signature_checkable).
        return
    sig_url = checksums_url + SIGNATURE_SUFFIX
    try:
        async with http.get(sig_url) as resp:
            _after_redirects(resp, policy)
            if resp.status != 200:
                raise BaseImageError(f"base_unsigned: {sig_url} answered HTTP {resp.status}")
            signature = await resp.content.read(1 << 20)
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise BaseImageError(f"base_download_failed: {sig_url}: {type(exc).__name__}: {exc}") from None
    await verify_signature(text.encode(), signature, policy.keyring, what=checksums_url)


async def verify_signature(data: bytes, signature: bytes, keyring: Path, *, what: str) -> None:
    """gpgv (Debian package gpgv): a detached signature by a key of `keyring`, or base_signature_bad."""
    with tempfile.TemporaryDirectory(prefix="gpuaas-gpgv-") as tmp:
        sig, body = Path(tmp) / "list.sig", Path(tmp) / "list"
        sig.write_bytes(signature)
        body.write_bytes(data)
        # --keyring: a name without a slash would be looked up in the (empty, private) home; the policy's is absolute.
        argv = ["gpgv", "--homedir", tmp, "--status-fd", "1", "--keyring", str(keyring), str(sig), str(body)]
        proc = await asyncio.create_subprocess_exec(
            *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=tool_env()
        )
        out, _err = await proc.communicate()
    if proc.returncode != 0 or not re.search(rb"^\[GNUPG:\] VALIDSIG ", out, re.M):
        status = [ln.split()[1] for ln in out.decode(errors="replace").splitlines() if ln.startswith("[GNUPG:] ")]
        raise BaseImageError(
            f"base_signature_bad: {what}{SIGNATURE_SUFFIX} is no valid signature by a key of the configured "
            f"keyring ({', '.join(dict.fromkeys(status)) or 'gpgv exit ' + str(proc.returncode)})"
        )


async def _get_text(http: aiohttp.ClientSession, url: str, policy: FetchPolicy) -> str:
    try:
        async with http.get(url) as resp:
            _after_redirects(resp, policy)
            if resp.status != 200:
                raise BaseImageError(f"base_download_failed: {url} answered HTTP {resp.status}")
            return await resp.text()
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise BaseImageError(f"base_download_failed: {url}: {type(exc).__name__}: {exc}") from None


async def _download(
    http: aiohttp.ClientSession, url: str, dst: Path, progress: Progress | None, policy: FetchPolicy
) -> str:
    h = hashlib.sha256()
    try:
        async with http.get(url) as resp:
            _after_redirects(resp, policy)
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
