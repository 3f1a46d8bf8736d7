"""Pull a slice image artifact from an OCI registry into the node-local cache, verifying while writing.

The artifact is the image pipeline's sparse stream (`application/vnd.gpuaas.sparse-raw.v1`):

    magic b"GPSPRS01" | virtual_size (u64 BE)
    repeated: offset | length (u64 BE each) | <length bytes>
    end:      virtual_size | 0 | sha256(raw image)

Data is written with pwrite at its offset into a file pre-sized with ftruncate, so holes stay holes
on the node. Two digests are computed in the same pass: the OCI blob digest over the bytes received
and the raw sha256 over the reconstructed image (holes hashed as zeros), which must equal the catalog
digest. Only a file that matches both is renamed into place; anything else is removed and reported.
"""

from __future__ import annotations

import hashlib
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import oras.provider

from gpuaas_common.sparse_format import CHUNK, MAGIC, MEDIA_TYPE, Progress, hash_zeros
from gpuaas_common.sparse_format import U64X2 as _U64X2

__all__ = ["CHUNK", "MAGIC", "MEDIA_TYPE", "Progress"]


class PullError(RuntimeError):
    """The transfer failed (registry unreachable, truncated stream): nothing was installed."""


class Malformed(RuntimeError):
    """The bytes received are not a well-formed artifact: treated like a digest mismatch."""


@dataclass(frozen=True)
class PullOutcome:
    status: str  # verified | mismatch
    raw_sha256: str | None
    blob_sha256: str
    bytes_received: int
    reason: str | None = None


def _client(tls_mode: str) -> oras.provider.Registry:
    return oras.provider.Registry(insecure=tls_mode == "plain-http", tls_verify=tls_mode == "verify")


def parse_ref(artifact_ref: str) -> tuple[str, str]:
    """`oci://host/repo:tag[@digest]` -> (host, repo)."""
    if not artifact_ref.startswith("oci://"):
        raise PullError(f"not an oci:// reference: {artifact_ref}")
    rest = artifact_ref[len("oci://") :].split("@", 1)[0]
    host, _, path = rest.partition("/")
    repo = path.rsplit(":", 1)[0]
    if not host or not repo:
        raise PullError(f"cannot parse artifact reference {artifact_ref}")
    return host, repo


class _Reader:
    def __init__(self, raw, blob_h) -> None:
        self.raw = raw
        self.blob_h = blob_h
        self.received = 0

    def read_into(self, view: memoryview) -> int:
        n = self.raw.readinto(view)
        if n:
            self.blob_h.update(view[:n])
            self.received += n
        return n

    def exact(self, n: int) -> bytes:
        buf = bytearray(n)
        view = memoryview(buf)
        got = 0
        while got < n:
            k = self.read_into(view[got:])
            if not k:
                raise Malformed(f"stream ended after {self.received} bytes")
            got += k
        return bytes(buf)


def pull_into_cache(
    *,
    artifact_ref: str,
    blob_digest: str,
    blob_size: int,
    expected_raw_sha256: str,
    dest: Path,
    tls_mode: str,
    endpoint: str | None = None,
    progress: Progress | None = None,
) -> PullOutcome:
    """Blocking; run it in a thread. `endpoint` replaces the reference's host (a node-local mirror)."""
    host, repo = parse_ref(artifact_ref)
    reg = _client(tls_mode)
    container = reg.get_container(f"{endpoint or host}/{repo}")
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.pull-{os.getpid()}")
    raw_h, blob_h = hashlib.sha256(), hashlib.sha256()
    try:
        try:
            resp = reg.get_blob(container, blob_digest, stream=True)
        except Exception as exc:  # requests raises many types for "nobody there"
            raise PullError(f"registry {endpoint or host}: {exc}") from None
        if resp.status_code != 200:
            raise PullError(f"registry answered HTTP {resp.status_code} for {blob_digest}")
        try:
            outcome, received = _receive(resp, tmp, raw_h, blob_h, blob_size, progress)
        except Exception as exc:  # a broken connection or a full disk: nothing installed, worth a retry
            raise PullError(f"transfer failed: {exc!r}") from None
        if outcome is not None:
            return outcome
        return _install(tmp, dest, raw_h, blob_h, received, blob_digest, expected_raw_sha256)
    finally:
        tmp.unlink(missing_ok=True)


def _receive(
    resp, tmp: Path, raw_h, blob_h, blob_size: int, progress: Progress | None
) -> tuple[PullOutcome | None, int]:
    with resp, tmp.open("wb") as out:
        reader = _Reader(resp.raw, blob_h)
        try:
            trailer = _unpack(reader, out.fileno(), raw_h, blob_size, progress)
        except Malformed as exc:
            return PullOutcome("mismatch", None, blob_h.hexdigest(), reader.received, f"malformed artifact: {exc}"), 0
        # Drain what is left so the blob digest covers every byte the registry sent.
        spare = memoryview(bytearray(1 << 16))
        while reader.read_into(spare):
            pass
        os.fsync(out.fileno())
        if trailer != raw_h.digest():
            return PullOutcome(
                "mismatch",
                raw_h.hexdigest(),
                blob_h.hexdigest(),
                reader.received,
                "artifact trailer disagrees with the data received",
            ), reader.received
        return None, reader.received


def _install(
    tmp: Path, dest: Path, raw_h, blob_h, received: int, blob_digest: str, expected_raw_sha256: str
) -> PullOutcome:
    raw_digest, blob_seen = raw_h.hexdigest(), blob_h.hexdigest()
    reasons = []
    if f"sha256:{blob_seen}" != blob_digest:
        reasons.append(f"blob digest sha256:{blob_seen} != {blob_digest}")
    if raw_digest != expected_raw_sha256:
        reasons.append(f"image digest {raw_digest} != catalog {expected_raw_sha256}")
    if reasons:
        return PullOutcome("mismatch", raw_digest, blob_seen, received, "; ".join(reasons))
    os.replace(tmp, dest)  # atomic: a reader sees the old image or the verified new one, never a mix
    dir_fd = os.open(dest.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return PullOutcome("verified", raw_digest, blob_seen, received)


def _unpack(reader: _Reader, fd: int, raw_h, blob_size: int, progress: Progress | None) -> bytes:
    head = reader.exact(16)
    if head[:8] != MAGIC:
        raise Malformed("bad magic")
    (size,) = struct.unpack(">Q", head[8:])
    os.ftruncate(fd, size)
    pos = 0
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    while True:
        offset, length = _U64X2.unpack(reader.exact(16))
        if length == 0:
            if offset != size:
                raise Malformed("end record does not carry the image size")
            hash_zeros(raw_h, size - pos)
            return reader.exact(32)
        if offset < pos or offset + length > size:
            raise Malformed(f"extent {offset}+{length} out of order or past {size}")
        hash_zeros(raw_h, offset - pos)
        left, at = length, offset
        while left:
            n = reader.read_into(view[: min(left, CHUNK)])
            if not n:
                raise Malformed(f"stream ended inside the extent at {offset}")
            raw_h.update(view[:n])
            written = 0
            while written < n:
                written += os.pwrite(fd, view[written:n], at + written)
            at += n
            left -= n
            if progress:
                progress(reader.received, blob_size)
        pos = offset + length
