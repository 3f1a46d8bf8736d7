"""Raw slice disks: clone an image onto them, wipe them, and prove the wipe.

Regular files stand in for NVMe devices in tests and on simulated hosts; the code path for them is the
same up to the point where a block device needs blkdiscard.
"""

from __future__ import annotations

import asyncio
import json
import os
import stat
from datetime import UTC, datetime
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field

from gpuaas_common.logging import get_logger

log = get_logger(__name__)

_ZERO_CHUNK = 4 << 20


class DiskError(Exception):
    """A disk operation failed. `code` is a stable reason for results; `stderr` is the tool's own words."""

    def __init__(self, code: str, message: str, *, rc: int | None = None, stderr: str = "") -> None:
        self.code = code
        self.rc = rc
        self.stderr = stderr
        super().__init__(message)


class DiskSignature(BaseModel):
    source: Literal["wipefs", "blkid"]
    type: str | None = None
    offset: str | None = None
    uuid: str | None = None
    label: str | None = None

    def __str__(self) -> str:
        where = f"@{self.offset}" if self.offset else ""
        return f"{self.type or 'unknown'}{where} ({self.source})"


class WipeProof(BaseModel):
    device: str
    method: str
    verified: bool
    signatures: list[DiskSignature] = Field(default_factory=list)
    checked_at: datetime
    detail: str | None = None


class _Run(BaseModel):
    rc: int
    stdout: str
    stderr: str


async def _run(*argv: str, timeout_s: float | None = None) -> _Run:
    """Run a tool without a shell. Raises FileNotFoundError when the tool is not installed."""
    # LC_ALL=C: error classification matches the tools' English messages.
    proc = await asyncio.create_subprocess_exec(
        *argv,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "LC_ALL": "C"},
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout_s)
    except (asyncio.TimeoutError, asyncio.CancelledError):
        proc.kill()
        await proc.wait()
        raise
    assert proc.returncode is not None
    return _Run(rc=proc.returncode, stdout=out.decode(errors="replace"), stderr=err.decode(errors="replace").strip())


def _kind(path: Path) -> Literal["block", "file"]:
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        raise DiskError("disk_missing", f"{path} does not exist") from None
    if stat.S_ISBLK(mode):
        return "block"
    if stat.S_ISREG(mode):
        return "file"
    raise DiskError("disk_not_block_device", f"{path} is neither a block device nor a regular file")


def disk_source_type(path: str | os.PathLike[str]) -> Literal["block", "file"]:
    """What libvirt's <disk type=…> must say for this path (stat()s it)."""
    return _kind(Path(path))


# --- clone ---------------------------------------------------------------------------------------------


def _classify_qemu_img_error(stderr: str) -> str:
    text = stderr.lower()
    if "smaller than" in text:
        return "target_too_small"
    if "could not open" in text and ("no such file" in text or "not found" in text):
        return "source_missing"
    if "image is not in" in text or ("invalid" in text and "format" in text) or "unknown driver" in text:
        return "source_format_mismatch"
    if "permission denied" in text:
        return "permission_denied"
    if "no space left" in text:
        return "no_space"
    return "clone_failed"


async def clone_image(
    src: str | os.PathLike[str], src_format: str, dst: str | os.PathLike[str], *, timeout_s: float | None = None
) -> None:
    """Convert `src` (qcow2, raw, …) onto the pre-existing `dst` as raw. `-f` is always given: probing the
    format of an untrusted image is unsafe. The target is never created or resized (`-n`)."""
    if src_format not in {"raw", "qcow2", "vmdk", "vdi", "vhdx", "vpc"}:
        raise DiskError("source_format_unsupported", f"unsupported source format {src_format!r}")
    src_p, dst_p = Path(src), Path(dst)
    if not await asyncio.to_thread(src_p.is_file):
        raise DiskError("source_missing", f"source image {src_p} does not exist")
    kind = _kind(dst_p)
    argv = ["qemu-img", "convert", "-n", "-f", src_format, "-O", "raw"]
    if kind == "block":
        # Bypass the host page cache: the guest reads the device directly right after the clone.
        argv += ["-t", "none", "-T", "none"]
    argv += [str(src_p), str(dst_p)]
    log.info("disk_clone_started", src=str(src_p), src_format=src_format, dst=str(dst_p), kind=kind)
    try:
        res = await _run(*argv, timeout_s=timeout_s)
    except FileNotFoundError:
        raise DiskError("tool_missing", "qemu-img is not installed") from None
    except asyncio.TimeoutError:
        raise DiskError("clone_timeout", f"qemu-img convert did not finish within {timeout_s}s") from None
    if res.rc != 0:
        code = _classify_qemu_img_error(res.stderr)
        log.error("disk_clone_failed", dst=str(dst_p), rc=res.rc, reason_code=code, stderr=res.stderr)
        raise DiskError(
            code,
            f"qemu-img convert to {dst_p} failed ({code}, rc {res.rc}): {res.stderr}",
            rc=res.rc,
            stderr=res.stderr,
        )
    log.info("disk_clone_finished", dst=str(dst_p))


# --- wipe ----------------------------------------------------------------------------------------------


def _zero_fill(path: Path) -> None:
    # In place, not truncate+extend: the stand-in keeps its inode and size just as a device would.
    size = path.stat().st_size
    zeros = bytes(_ZERO_CHUNK)
    with path.open("r+b") as f:
        written = 0
        while written < size:
            n = min(_ZERO_CHUNK, size - written)
            f.write(zeros[:n])
            written += n
        f.flush()
        os.fsync(f.fileno())


async def _discard_zeroes(dev: Path) -> bool:
    try:
        res = await _run("lsblk", "-n", "-d", "-o", "DISC-ZERO", str(dev))
    except FileNotFoundError:
        return False
    return res.rc == 0 and res.stdout.strip() == "1"


async def wipe(dst: str | os.PathLike[str]) -> str:
    """Destroy the disk's contents; returns the method used. The caller must already have refused mounted
    devices. Raises DiskError when no method succeeded."""
    path = Path(dst)
    kind = _kind(path)
    if kind == "file":
        await asyncio.to_thread(_zero_fill, path)
        method = "zero_fill"
    else:
        method = await _wipe_block(path)
    log.info("disk_wiped", device=str(path), method=method)
    return method


async def _wipe_block(dev: Path) -> str:
    try:
        discard = await _run("blkdiscard", "-f", str(dev))
    except FileNotFoundError:
        raise DiskError("tool_missing", "blkdiscard is not installed") from None
    if discard.rc == 0 and await _discard_zeroes(dev):
        return "blkdiscard"
    if discard.rc != 0:
        log.warning("disk_discard_failed", device=str(dev), rc=discard.rc, stderr=discard.stderr)
    # Discarded blocks need not read back as zeros; -z writes zeros (offloaded where the device can).
    zero = await _run("blkdiscard", "-f", "-z", str(dev))
    if zero.rc != 0:
        raise DiskError(
            "wipe_failed", f"blkdiscard -z {dev} failed (rc {zero.rc}): {zero.stderr}", rc=zero.rc, stderr=zero.stderr
        )
    return "blkdiscard+zeroout" if discard.rc == 0 else "zeroout"


# --- verify --------------------------------------------------------------------------------------------


async def _wipefs_signatures(path: Path) -> list[DiskSignature]:
    res = await _run("wipefs", "--json", str(path))
    if res.rc != 0:
        raise DiskError("verify_failed", f"wipefs rc {res.rc}: {res.stderr}", rc=res.rc, stderr=res.stderr)
    if not res.stdout.strip():
        return []  # older util-linux prints nothing at all for a clean device
    try:
        entries = json.loads(res.stdout)["signatures"]
        return [
            DiskSignature(
                source="wipefs", type=e.get("type"), offset=e.get("offset"), uuid=e.get("uuid"), label=e.get("label")
            )
            for e in entries
        ]
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise DiskError("verify_failed", f"unexpected wipefs output: {exc}") from exc


async def _blkid_signatures(path: Path) -> list[DiskSignature]:
    res = await _run("blkid", "-p", "-o", "export", str(path))
    if res.rc == 2:
        return []
    if res.rc != 0:
        raise DiskError("verify_failed", f"blkid rc {res.rc}: {res.stderr}", rc=res.rc, stderr=res.stderr)
    values = dict(line.split("=", 1) for line in res.stdout.splitlines() if "=" in line)
    kind = values.get("TYPE") or values.get("PTTYPE") or "unknown"
    return [
        DiskSignature(
            source="blkid", type=kind, uuid=values.get("UUID") or values.get("PTUUID"), label=values.get("LABEL")
        )
    ]


async def signatures(dst: str | os.PathLike[str]) -> list[DiskSignature]:
    """What wipefs and blkid find on the disk now, read-only. Raises DiskError when a probe cannot run (a
    missing tool included): "nothing found" must never stand in for "not looked"."""
    path = Path(dst)
    _kind(path)
    found: list[DiskSignature] = []
    for tool, check in (("wipefs", _wipefs_signatures), ("blkid", _blkid_signatures)):
        try:
            found += await check(path)
        except FileNotFoundError:
            raise DiskError("tool_missing", f"{tool} is not installed") from None
    return found


async def verify_wiped(dst: str | os.PathLike[str], method: str = "unspecified") -> WipeProof:
    """Both wipefs and blkid must run and find nothing. A check that cannot run gives verified=False with
    the reason in `detail`, never a pass."""
    path = Path(dst)
    signatures: list[DiskSignature] = []
    problems: list[str] = []
    try:
        # blkid exits 2 for a missing device too, which would read as "nothing found".
        _kind(path)
    except DiskError as exc:
        problems.append(str(exc))
    else:
        for tool, check in (("wipefs", _wipefs_signatures), ("blkid", _blkid_signatures)):
            try:
                signatures += await check(path)
            except FileNotFoundError:
                problems.append(f"{tool} is not installed")
            except DiskError as exc:
                problems.append(str(exc))
    verified = not problems and not signatures
    detail = (
        "; ".join(problems)
        if problems
        else ("signatures remain: " + ", ".join(map(str, signatures)) if signatures else None)
    )
    proof = WipeProof(
        device=str(path),
        method=method,
        verified=verified,
        signatures=signatures,
        checked_at=datetime.now(UTC),
        detail=detail,
    )
    log_fn = log.info if verified else log.warning
    log_fn(
        "disk_wipe_verified" if verified else "disk_wipe_not_verified",
        device=str(path),
        method=method,
        signatures=[str(s) for s in signatures],
        detail=detail,
    )
    return proof


async def wipe_and_verify(dst: str | os.PathLike[str]) -> WipeProof:
    """Wipe, then verify; the proof carries the method actually used. A failed wipe is an unverified proof."""
    try:
        method = await wipe(dst)
    except DiskError as exc:
        return WipeProof(
            device=str(dst), method="failed", verified=False, checked_at=datetime.now(UTC), detail=f"{exc.code}: {exc}"
        )
    return await verify_wiped(dst, method)
