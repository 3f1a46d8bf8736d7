"""qemu-img conversion and the customisation plug-ins."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from gpuaas_common.logging import get_logger

log = get_logger(__name__)

Progress = Callable[[int, int], None]
_PCT = re.compile(rb"\((\d+(?:\.\d+)?)/100%\)")
# Where the local plug-in writes its build stamp: past the first MiB, clear of the partition table and
# of the boot sector a clone is checked by.
STAMP_OFFSET = 1 << 20


# What the image tools read from the environment: where to find programs and libraries' data, the locale,
# scratch space, libguestfs's own settings (virt-customize) and a proxy for its --network installs. Nothing
# else passes: the service's environment holds the database URL, the admin token and the path to its NATS
# creds, and a tool (or a package script it runs) has no business with them.
_TOOL_ENV = ("PATH", "LANG", "LC_ALL", "HOME", "TMPDIR", "http_proxy", "https_proxy", "no_proxy")
_TOOL_ENV_PREFIXES = ("LIBGUESTFS_",)


def tool_env() -> dict[str, str]:
    """The environment every image tool runs with: the service's, cut to the allow-list above."""
    return {k: v for k, v in os.environ.items() if k in _TOOL_ENV or k.startswith(_TOOL_ENV_PREFIXES)}


class ImageToolError(RuntimeError):
    pass


@dataclass(frozen=True)
class ToolLimits:
    """What one image tool may use: a crafted image (a qcow2 with a huge L1 table, a refcount loop) must cost
    the build host a failed build, not its memory or a core for ever. Applied with prlimit(1) (util-linux) on
    the tool's own process, so the service itself is never limited."""

    address_space_bytes: int = 8 << 30
    cpu_seconds: int = 7200

    def argv(self) -> list[str]:
        return ["prlimit", f"--as={self.address_space_bytes}", f"--cpu={self.cpu_seconds}", "--"]


DEFAULT_LIMITS = ToolLimits()

# The only formats a build takes in: both are passed with -f, never probed (a probed "raw" file that looks like
# a qcow2 or a vmdk would be opened as one, with whatever backing file its header names).
SOURCE_FORMATS = ("raw", "qcow2")


class ImageRefused(ImageToolError):
    """One line starting with its reason code: image_format_refused, image_backing_file_refused,
    image_data_file_refused, image_unreadable."""


async def _run(*argv: str, on_output: Callable[[bytes], None] | None = None, limits: ToolLimits | None = None) -> bytes:
    full = [*(limits.argv() if limits else []), *argv]
    proc = await asyncio.create_subprocess_exec(
        *full, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=tool_env()
    )
    assert proc.stdout and proc.stderr
    out = bytearray()
    while chunk := await proc.stdout.read(4096):
        out += chunk
        if on_output:
            on_output(bytes(out[-256:]))
    err = await proc.stderr.read()
    if await proc.wait() != 0:
        raise ImageToolError(
            f"{argv[0]} {argv[1] if len(argv) > 1 else ''} failed: {err.decode(errors='replace')[-2000:]}"
        )
    return bytes(out)


def _tool_path(path: Path) -> str:
    """Absolute, so qemu-img never reads a file name as a protocol (`json:{...}`, `nbd://...`)."""
    return str(path.absolute())


async def image_info(path: Path, fmt: str, limits: ToolLimits = DEFAULT_LIMITS) -> dict:
    """qemu-img's view of the image opened as `fmt` (never probed); qemu-img info opens no backing file."""
    return json.loads(await _run("qemu-img", "info", "-f", fmt, "--output=json", _tool_path(path), limits=limits))


def refusal(info: dict, fmt: str) -> str | None:
    """Why an input image may not be read (None: it may). A backing file or an external data file names
    a file of the build host, whose bytes a conversion would copy into the tenant's image."""
    if fmt not in SOURCE_FORMATS or info.get("format") != fmt:
        return f"image_format_refused: {fmt!r} is not one of {', '.join(SOURCE_FORMATS)}"
    backing = info.get("backing-filename") or info.get("full-backing-filename")
    if backing:
        return f"image_backing_file_refused: the {fmt} image names a backing file ({str(backing)[:200]})"
    data = ((info.get("format-specific") or {}).get("data") or {}).get("data-file")
    if data:
        return f"image_data_file_refused: the {fmt} image names an external data file ({str(data)[:200]})"
    return None


async def checked_input(path: Path, fmt: str, limits: ToolLimits = DEFAULT_LIMITS) -> dict:
    """The image's info once it passed `refusal`; ImageRefused otherwise. Every build input goes through here
    before any tool converts it."""
    if fmt not in SOURCE_FORMATS:
        raise ImageRefused(f"image_format_refused: {fmt!r} is not one of {', '.join(SOURCE_FORMATS)}")
    try:
        info = await image_info(path, fmt, limits)
    except ImageToolError as exc:
        last = str(exc).strip().splitlines()[-1:] or [""]
        raise ImageRefused(f"image_unreadable: not a {fmt} image qemu-img can open: {last[0][:300]}") from None
    if why := refusal(info, fmt):
        raise ImageRefused(why)
    return info


async def convert_to_raw(
    src: Path, src_format: str, dst: Path, progress: Progress | None = None, limits: ToolLimits = DEFAULT_LIMITS
) -> None:
    """Sparse raw: `-S 4k` leaves every all-zero 4 KiB block a hole, which is what keeps the artifact small."""

    def on_output(tail: bytes) -> None:
        found = _PCT.findall(tail)
        if found and progress:
            progress(int(float(found[-1]) * 100), 10_000)

    tmp = dst.with_name(dst.name + ".part")
    await _run(
        "qemu-img", "convert", "-p", "-f", src_format, "-O", "raw", "-S", "4k", _tool_path(src), str(tmp),
        on_output=on_output, limits=limits,
    )  # fmt: skip
    tmp.replace(dst)


class Customiser(Protocol):
    name: str

    def plan(self, image: Path, packages: list[str]) -> list[str]: ...

    async def customise(self, image: Path, packages: list[str], stamp: dict) -> None: ...


class NoCustomiser:
    name = "none"

    def plan(self, image: Path, packages: list[str]) -> list[str]:
        return []

    async def customise(self, image: Path, packages: list[str], stamp: dict) -> None:
        return None


class StampCustomiser:
    """Dev only: edits the qcow2 through qemu's block layer (qemu-io), writing a JSON build stamp (build id,
    slug, package list) into the disk, so every build yields a distinct, traceable raw; it installs nothing
    and needs neither root nor a real image. Real images are customised by `chroot` (customise_chroot)."""

    name = "stamp"

    def plan(self, image: Path, packages: list[str]) -> list[str]:
        return [f"qemu-io -f qcow2 -c 'write -s <stamp.json> {STAMP_OFFSET} 4096' {image}"]

    async def customise(self, image: Path, packages: list[str], stamp: dict) -> None:
        blob = json.dumps({**stamp, "packages": packages}, sort_keys=True).encode()
        if len(blob) > 4096:
            raise ImageToolError("build stamp larger than 4 KiB")
        stamp_file = image.with_suffix(".stamp")
        stamp_file.write_bytes(blob.ljust(4096, b"\0"))
        await _run("qemu-io", "-f", "qcow2", "-c", f"write -q -s {stamp_file} {STAMP_OFFSET} 4096", str(image))
        stamp_file.unlink()


class VirtCustomizeCustomiser:
    """Production plug-in (libguestfs): installs the guest GPU/RDMA package list into the qcow2.

    The runbook's preferred production path is the chroot customiser (customise_chroot), which falls back to
    this one on a build host that has neither loop devices nor nbd. It does not run in CI (no libguestfs
    appliance)."""

    name = "virt-customize"

    @staticmethod
    def _guest_files() -> list[str]:
        """The readiness unit and the GPU report script the chroot customiser installs, the same files."""
        from .customise_chroot import GPU_REPORT_SCRIPT, READY_UNIT, READY_UNIT_TEXT, gpu_report_source

        script, unit = f"/{GPU_REPORT_SCRIPT}", f"/etc/systemd/system/{READY_UNIT}"
        return [
            "--mkdir", str(Path(script).parent),
            "--write", f"{script}:{gpu_report_source()}",
            "--chmod", f"0755:{script}",
            "--write", f"{unit}:{READY_UNIT_TEXT}",
            "--link", f"{unit}:/etc/systemd/system/multi-user.target.wants/{READY_UNIT}",
        ]  # fmt: skip

    def plan(self, image: Path, packages: list[str]) -> list[str]:
        argv = ["virt-customize", "-a", str(image), "--network"]
        if packages:
            argv += ["--install", ",".join(packages)]
        files = self._guest_files()
        argv += [f"{opt} {arg.split(':', 1)[0]}" for opt, arg in zip(files[::2], files[1::2], strict=True)]
        return [" ".join(argv)]

    async def customise(self, image: Path, packages: list[str], stamp: dict) -> None:
        if not shutil.which("virt-customize"):
            raise ImageToolError("virt-customize is not installed (Debian package libguestfs-tools)")
        argv = ["virt-customize", "-a", str(image), "--network"]
        if packages:
            argv += ["--install", ",".join(packages)]
        argv += self._guest_files()
        argv += ["--write", f"/etc/gpuaas-image-build.json:{json.dumps(stamp, sort_keys=True)}"]
        await _run(*argv)


CUSTOMISERS: dict[str, Customiser] = {c.name: c for c in (NoCustomiser(), StampCustomiser(), VirtCustomizeCustomiser())}


async def convert_to_qcow2(src: Path, src_format: str, dst: Path, limits: ToolLimits = DEFAULT_LIMITS) -> None:
    if src_format not in SOURCE_FORMATS:
        raise ImageRefused(f"image_format_refused: {src_format!r} is not one of {', '.join(SOURCE_FORMATS)}")
    await _run("qemu-img", "convert", "-f", src_format, "-O", "qcow2", _tool_path(src), str(dst), limits=limits)


# Last: the chroot plug-in builds on this module and enters itself in CUSTOMISERS when imported.
from . import customise_chroot  # noqa: E402, F401
