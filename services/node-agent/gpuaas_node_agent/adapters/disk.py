"""Raw slice disks: clone an image onto them, wipe them, and prove the wipe.

Regular files stand in for NVMe devices in tests and on simulated hosts; the code path for them is the
same up to the point where a block device needs blkdiscard.
"""

from __future__ import annotations

import asyncio
import ctypes
import json
import os
import secrets
import stat
from datetime import UTC, datetime
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field

from gpuaas_common.contract import WipePolicy as Policy
from gpuaas_common.contract.messages import WipePolicy
from gpuaas_common.logging import get_logger

log = get_logger(__name__)

_ZERO_CHUNK = 4 << 20
_FORMAT_TIMEOUT_S = 600.0
WIPE_POLICIES: tuple[str, ...] = tuple(Policy)


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
    verification: str | None = None  # what was checked, in words (contract WipeProof.verification)


class _Run(BaseModel):
    rc: int
    stdout: str
    stderr: str


async def run_tool(*argv: str, timeout_s: float | None = None) -> _Run:
    """Run a host tool without a shell (also the guest SSH checks' runner). Raises FileNotFoundError when the
    tool is not installed."""
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
        res = await run_tool(*argv, timeout_s=timeout_s)
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
        res = await run_tool("lsblk", "-n", "-d", "-o", "DISC-ZERO", str(dev))
    except FileNotFoundError:
        return False
    return res.rc == 0 and res.stdout.strip() == "1"


async def wipe(dst: str | os.PathLike[str], policy: WipePolicy | None = None) -> str:
    """Destroy the disk's contents by the site's policy (None: the agent's default, blkdiscard or a zero fill);
    returns the method used. The caller must already have refused mounted devices. Raises DiskError when the
    policy's method did not succeed (never silently another method: the scheduler judges the method)."""
    path = Path(dst)
    kind = _kind(path)
    if policy is not None and policy not in WIPE_POLICIES:
        raise DiskError("wipe_policy_unknown", f"unknown wipe policy {policy!r}")
    if kind == "file":
        method = await asyncio.to_thread(_erase_file, path, policy)
    elif policy in (None, Policy.BLKDISCARD):
        method = await _wipe_block(path)
    else:
        method = await _nvme_format(path, policy)
    log.info("disk_wiped", device=str(path), method=method, policy=policy)
    return method


# On a regular file standing in for an NVMe namespace each policy's method is emulated by its effect on the
# data, which is what the read-back verification checks: a discard punches a hole over the whole file (what a
# loop device does with BLKDISCARD; it reads back as zeros), `nvme format` with secure erase setting 1 (user
# data erase) is a zero fill (a drive that deallocates on format reads zeros), and a crypto erase replaces the
# contents with random bytes (the old ciphertext under a fresh media key reads as noise).
_FALLOC_FL_KEEP_SIZE, _FALLOC_FL_PUNCH_HOLE = 0x01, 0x02


def _punch_hole(path: Path) -> bool:
    """Deallocate the whole file in place; False when the file system cannot."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
    size = path.stat().st_size
    with path.open("r+b") as f:
        rc = libc.fallocate(f.fileno(), _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, 0, size)
        if rc != 0:
            return False
        os.fsync(f.fileno())
    return True


def _random_fill(path: Path) -> None:
    size = path.stat().st_size
    with path.open("r+b") as f:
        written = 0
        while written < size:
            n = min(_ZERO_CHUNK, size - written)
            f.write(os.urandom(n))
            written += n
        f.flush()
        os.fsync(f.fileno())


def _erase_file(path: Path, policy: WipePolicy | None) -> str:
    if policy == Policy.BLKDISCARD and _punch_hole(path):
        return "blkdiscard"
    if policy == Policy.CRYPTO_ERASE:
        _random_fill(path)
        return "crypto_erase"
    _zero_fill(path)
    # A zero fill satisfies the blkdiscard policy too (nothing of the tenant's data remains readable).
    return "nvme_format" if policy == Policy.NVME_FORMAT else "zero_fill"


async def _nvme_format(dev: Path, policy: WipePolicy) -> str:
    """`nvme format` of the namespace: secure erase setting 1 (user data erase) or 2 (cryptographic erase)."""
    ses = "1" if policy == Policy.NVME_FORMAT else "2"
    try:
        res = await run_tool("nvme", "format", str(dev), f"--ses={ses}", "--force", timeout_s=_FORMAT_TIMEOUT_S)
    except FileNotFoundError:
        raise DiskError("tool_missing", "nvme-cli is not installed") from None
    except asyncio.TimeoutError:
        raise DiskError("wipe_timeout", f"nvme format {dev} did not finish within {_FORMAT_TIMEOUT_S}s") from None
    if res.rc != 0:
        raise DiskError(
            "wipe_failed",
            f"nvme format --ses={ses} {dev} failed (rc {res.rc}): {res.stderr}",
            rc=res.rc,
            stderr=res.stderr,
        )
    # What is read back next must come from the device, not from blocks the kernel cached before the format.
    try:
        await run_tool("blockdev", "--flushbufs", str(dev))
    except FileNotFoundError:
        pass
    return str(policy)


async def _wipe_block(dev: Path) -> str:
    try:
        discard = await run_tool("blkdiscard", "-f", str(dev))
    except FileNotFoundError:
        raise DiskError("tool_missing", "blkdiscard is not installed") from None
    if discard.rc == 0 and await _discard_zeroes(dev):
        return "blkdiscard"
    if discard.rc != 0:
        log.warning("disk_discard_failed", device=str(dev), rc=discard.rc, stderr=discard.stderr)
    # Discarded blocks need not read back as zeros; -z writes zeros (offloaded where the device can).
    zero = await run_tool("blkdiscard", "-f", "-z", str(dev))
    if zero.rc != 0:
        raise DiskError(
            "wipe_failed", f"blkdiscard -z {dev} failed (rc {zero.rc}): {zero.stderr}", rc=zero.rc, stderr=zero.stderr
        )
    return "blkdiscard+zeroout" if discard.rc == 0 else "zeroout"


# --- verify --------------------------------------------------------------------------------------------


async def _wipefs_signatures(path: Path) -> list[DiskSignature]:
    res = await run_tool("wipefs", "--json", str(path))
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
    res = await run_tool("blkid", "-p", "-o", "export", str(path))
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


# --- read-back -------------------------------------------------------------------------------------------

_BLOCK = 4096
_SPREAD_SAMPLES = 32
_RANDOM_SAMPLES = 32
# Methods whose effect is that every block reads back as zeros.
_ZEROING = frozenset({"blkdiscard", "blkdiscard+zeroout", "zeroout", "zero_fill"})


def sample_offsets(size: int) -> list[int]:
    """Block-aligned offsets to read before and after a wipe: the first and last blocks (partition tables and
    their backups), blocks spread evenly over the disk, and random ones nobody can arrange for in advance."""
    blocks = max(size // _BLOCK, 1)
    picks = {0, blocks - 1}
    picks |= {blocks * i // _SPREAD_SAMPLES for i in range(_SPREAD_SAMPLES)}
    picks |= {secrets.randbelow(blocks) for _ in range(_RANDOM_SAMPLES)}
    return sorted(b * _BLOCK for b in picks)


def read_blocks(path: Path, offsets: list[int]) -> list[bytes]:
    with path.open("rb") as f:
        out = []
        for off in offsets:
            f.seek(off)
            out.append(f.read(_BLOCK))
        return out


def readback_problems(method: str, before: list[bytes], after: list[bytes], offsets: list[int]) -> list[str]:
    """What the sampled blocks say about a wipe by `method`: after a zeroing method every block reads zeros;
    after a format or crypto erase (contents indeterminate) no block that held data reads back unchanged."""
    problems = []
    for off, old, new in zip(offsets, before, after, strict=True):
        if method in _ZEROING:
            if new.count(0) != len(new):
                problems.append(f"block at {off} is not zero after {method}")
        elif old.count(0) != len(old) and new == old:
            problems.append(f"block at {off} still holds its data after {method}")
    return problems


async def wipe_and_verify(dst: str | os.PathLike[str], policy: WipePolicy | None = None) -> WipeProof:
    """Sample blocks, wipe by the policy's method, then verify: no signatures (wipefs, blkid) and the sampled
    blocks read back as the method's effect says. The proof carries the method actually used and what was
    checked; a failed wipe or check is an unverified proof."""
    path = Path(dst)
    try:
        kind = _kind(path)
        size = (await asyncio.to_thread(path.stat)).st_size if kind == "file" else await _block_size(path)
        offsets = sample_offsets(size)
        before = await asyncio.to_thread(read_blocks, path, offsets)
        method = await wipe(path, policy)
    except (DiskError, OSError) as exc:
        code = exc.code if isinstance(exc, DiskError) else "read_failed"
        return WipeProof(
            device=str(dst), method="failed", verified=False, checked_at=datetime.now(UTC), detail=f"{code}: {exc}"
        )
    proof = await verify_wiped(path, method)
    try:
        after = await asyncio.to_thread(read_blocks, path, offsets)
        problems = readback_problems(method, before, after, offsets)
    except OSError as exc:
        problems = [f"read-back failed: {exc}"]
    rule = "read back as zeros" if method in _ZEROING else "no longer hold their data"
    verification = (
        f"signatures: wipefs and blkid {'found none' if proof.verified else 'did not pass'}; read-back: "
        f"{len(offsets)} sampled {_BLOCK}-byte blocks {rule}: {'yes' if not problems else 'NO'}"
        + ("; simulated on a regular file" if kind == "file" else "")
    )
    if problems:
        detail = "; ".join(
            filter(None, [proof.detail, f"{len(problems)} sampled blocks fail: " + "; ".join(problems[:4])])
        )
        log.warning("disk_readback_failed", device=str(path), method=method, problems=problems[:8])
        return proof.model_copy(update={"verified": False, "detail": detail, "verification": verification})
    return proof.model_copy(update={"verification": verification})


async def _block_size(dev: Path) -> int:
    try:
        res = await run_tool("blockdev", "--getsize64", str(dev))
    except FileNotFoundError:
        raise DiskError("tool_missing", "blockdev is not installed") from None
    if res.rc != 0 or not res.stdout.strip().isdigit():
        raise DiskError("verify_failed", f"blockdev --getsize64 {dev} failed (rc {res.rc}): {res.stderr}")
    return int(res.stdout.strip())
