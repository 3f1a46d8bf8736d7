"""The production customiser: the image's root filesystem mounted on the build host, packages installed with
the guest's own apt in a chroot that uses the host's network.

How the disk is opened depends on what the build host has, tried in this order:

- nbd: `qemu-nbd --connect` exposes the qcow2 as /dev/nbdN (needs the nbd kernel module);
- loop: the qcow2 is converted to a sparse raw, which a loop device exposes, then converted back;
- virt-customize: libguestfs boots an appliance of its own (slow, but needs neither root nor a module).

In both chroot methods the root partition gets a loop device of its own at its offset in the disk, found
by reading the partition table here: loop partition scanning (`losetup --partscan`) makes no partition
nodes inside a container, where devtmpfs has no udev behind it, and an offset works the same on either.
Whatever fails, everything that was mounted is unmounted and every device detached before the error goes up.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import struct
import uuid
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

from gpuaas_common.logging import get_logger

from ..guest import gpu_report
from .paths import in_root
from .qemu import CUSTOMISERS, ImageToolError, VirtCustomizeCustomiser, convert_to_raw, tool_env

log = get_logger(__name__)

SECTOR = 512
# Labels root filesystems carry in the images we start from; an image with one ext4 partition needs none.
ROOT_LABELS = ("gpuaas-root", "cloudimg-rootfs")
READY_UNIT = "gpuaas-guest-ready.service"
READY_FILE = "/run/gpuaas-guest-ready"
STAMP_PATH = "etc/gpuaas-image-build.json"
# Debian package names (policy 5.6.1), optionally pinned to a version or an architecture.
_PACKAGE = re.compile(r"^[a-z0-9][a-z0-9+.-]+(:[a-z0-9]+)?(=[A-Za-z0-9.+:~-]+)?$")
_CHROOT_ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "DEBIAN_FRONTEND": "noninteractive",
    "LC_ALL": "C.UTF-8",
    "HOME": "/root",
}
# The guest side of the agent's GPU check: this script, run by the unit below, writes what the guest sees of its
# GPUs to GUEST_GPU_FILE (in /run, so a report never outlives the boot that wrote it), which the agent's login reads.
GPU_REPORT_SCRIPT = "usr/lib/gpuaas/guest-gpu-report"
GUEST_GPU_FILE = "/run/gpuaas/guest-gpus.json"
# Type=simple, not oneshot: cloud-final is ordered after multi-user.target, so a unit that multi-user.target
# waits for must not wait for cloud-init itself. Readiness is "cloud-init has finished", whatever an unrelated
# module reported; the status line it ended with is the file's content. The GPUs are looked at after cloud-init,
# which installs the driver of a cloud_init image, and before the ready file, so a guest marked ready has reported.
READY_UNIT_TEXT = f"""\
[Unit]
Description=gpuaas: mark the guest ready once cloud-init has finished, with the GPUs it sees
After=network.target

[Service]
Type=simple
RemainAfterExit=yes
ExecStart=/bin/sh -c 'if command -v cloud-init >/dev/null; then cloud-init status --wait > {READY_FILE}.tmp 2>&1; \
else echo "status: no cloud-init" > {READY_FILE}.tmp; fi; \
/usr/bin/python3 /{GPU_REPORT_SCRIPT} --out {GUEST_GPU_FILE}; mv {READY_FILE}.tmp {READY_FILE}'

[Install]
WantedBy=multi-user.target
"""


def gpu_report_source() -> str:
    """The guest's GPU report script, as the image gets it."""
    return Path(gpu_report.__file__).read_text()


class CustomiseError(ImageToolError):
    """One line starting with a reason code: package_not_in_archive, invalid_package_name,
    chroot_unavailable, no_root_filesystem, package_missing_after_build."""


@dataclass(frozen=True)
class Partition:
    index: int
    start: int
    size: int


async def _exec(*argv: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        *argv,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=tool_env() if env is None else env,
    )
    out, err = await proc.communicate()
    return proc.returncode or 0, out.decode(errors="replace"), err.decode(errors="replace")


async def _must(*argv: str, env: dict[str, str] | None = None) -> str:
    rc, out, err = await _exec(*argv, env=env)
    if rc != 0:
        raise ImageToolError(f"{' '.join(argv[:3])} failed ({rc}): {(err or out).strip()[-1500:]}")
    return out


# --- finding the root filesystem ------------------------------------------------------------------------


def partitions(disk: Path) -> list[Partition]:
    """The partitions of a GPT or MBR disk (a file or a block device); none when it has no table."""
    with disk.open("rb") as f:
        mbr = f.read(SECTOR)
        gpt = f.read(SECTOR)
        if gpt[:8] == b"EFI PART":
            entries_lba, count, size = struct.unpack_from("<QII", gpt, 72)
            f.seek(entries_lba * SECTOR)
            table = f.read(count * size)
            found = []
            for i in range(count):
                ptype, _uniq, first, last = struct.unpack_from("<16s16sQQ", table, i * size)
                if ptype != bytes(16):
                    found.append(Partition(i + 1, first * SECTOR, (last - first + 1) * SECTOR))
            return found
    if mbr[510:512] != b"\x55\xaa":
        return []
    found = []
    for i in range(4):
        ptype = mbr[446 + i * 16 + 4]
        start, count = struct.unpack_from("<II", mbr, 446 + i * 16 + 8)
        if ptype not in (0x00, 0x05, 0x0F, 0x85, 0xEE) and count:
            found.append(Partition(i + 1, start * SECTOR, count * SECTOR))
    return found


def ext4_label(disk: Path, offset: int) -> str | None:
    """The label of the ext2/3/4 filesystem at offset, "" when it has none, None when there is none there."""
    with disk.open("rb") as f:
        f.seek(offset + 1024)
        sb = f.read(1024)
    if len(sb) < 1024 or struct.unpack_from("<H", sb, 0x38)[0] != 0xEF53:
        return None
    return sb[0x78:0x88].rstrip(b"\0").decode(errors="replace")


def find_root(disk: Path) -> Partition:
    parts = partitions(disk)
    if not parts:
        if ext4_label(disk, 0) is not None:
            return Partition(0, 0, disk.stat().st_size if disk.is_file() else 0)
        raise CustomiseError("no_root_filesystem: the image has no partition table and no ext4 filesystem")
    ext = [(p, ext4_label(disk, p.start)) for p in parts]
    ext = [(p, label) for p, label in ext if label is not None]
    labelled = [p for p, label in ext if label in ROOT_LABELS]
    if labelled:
        return labelled[0]
    if len(ext) == 1:
        return ext[0][0]
    raise CustomiseError(f"no_root_filesystem: {len(ext)} ext4 partitions and none labelled {' or '.join(ROOT_LABELS)}")


# --- opening and mounting -------------------------------------------------------------------------------


@asynccontextmanager
async def loop_device(backing: Path, part: Partition, *, read_only: bool = False) -> AsyncIterator[str]:
    argv = ["losetup", "--find", "--show"]
    if part.start:
        argv += ["--offset", str(part.start), "--sizelimit", str(part.size)]
    if read_only:
        argv.append("--read-only")
    dev = (await _must(*argv, str(backing))).strip()
    try:
        yield dev
    finally:
        await _must("losetup", "--detach", dev)


@asynccontextmanager
async def mounted(dev: str, target: Path, *opts: str) -> AsyncIterator[Path]:
    await asyncio.to_thread(target.mkdir, parents=True, exist_ok=True)
    await _must("mount", *opts, dev, str(target))
    try:
        yield target
    finally:
        await _unmount(target)


async def _unmount(target: Path) -> None:
    rc, _out, err = await _exec("umount", str(target))
    if rc != 0:
        # Busy (a process left in the chroot): detached now, released by the kernel once it is gone, so the
        # loop device under it can still be let go.
        log.warning("chroot_unmount_busy", target=str(target), error=err.strip()[-300:])
        await _must("umount", "--lazy", str(target))


def _free_nbd() -> Path:
    for candidate in sorted(Path("/sys/block").glob("nbd*")):
        if not (candidate / "pid").exists():
            return Path("/dev") / candidate.name
    raise CustomiseError("chroot_unavailable: every /dev/nbd* is in use")


@asynccontextmanager
async def nbd_device(image: Path, fmt: str) -> AsyncIterator[Path]:
    dev = await asyncio.to_thread(_free_nbd)
    await _must("qemu-nbd", "--connect", str(dev), "--format", fmt, str(image))
    try:
        yield dev
    finally:
        await _must("qemu-nbd", "--disconnect", str(dev))


def _kill_chroot_processes(root: Path) -> None:
    """Daemons a maintainer script started in spite of policy-rc.d would keep the root busy."""
    for pid_dir in Path("/proc").iterdir():
        if not pid_dir.name.isdigit():
            continue
        try:
            if os.readlink(pid_dir / "root") == str(root):
                os.kill(int(pid_dir.name), 9)
        except (OSError, ValueError):
            continue


_CHROOT_MOUNTS = (
    ("/dev", "dev", ("--bind",)),
    ("/dev/pts", "dev/pts", ("--bind",)),
    ("proc", "proc", ("-t", "proc")),
    ("/sys", "sys", ("--bind",)),
)


@asynccontextmanager
async def chroot_mounts(root: Path) -> AsyncIterator[None]:
    async with AsyncExitStack() as stack:
        for src, at, opts in _CHROOT_MOUNTS:
            await stack.enter_async_context(mounted(src, root / at, *opts))
        try:
            yield
        finally:
            await asyncio.to_thread(_kill_chroot_processes, root)


@asynccontextmanager
async def host_resolver(root: Path) -> AsyncIterator[None]:
    """The host's resolv.conf in the guest for apt, the guest's own (a file or a link, often dangling in a
    stopped image) put back afterwards. Every path is the image's own (in_root): a link in etc never leads
    the rename or the copy into the build host."""
    etc = in_root(root, "etc")
    guest = etc / "resolv.conf"
    saved = etc / "resolv.conf.gpuaas-build"
    had = guest.exists() or guest.is_symlink()
    if had:
        guest.rename(saved)
    try:
        shutil.copyfile("/etc/resolv.conf", guest, follow_symlinks=False)
        yield
    finally:
        guest.unlink(missing_ok=True)
        if had:
            saved.rename(guest)


@asynccontextmanager
async def no_service_starts(root: Path) -> AsyncIterator[None]:
    """policy-rc.d forbids maintainer scripts to start services: a daemon started in the chroot would run on
    the build host and hold the mount."""
    policy = in_root(root, "usr/sbin", follow_last=True) / "policy-rc.d"
    existed = policy.exists() or policy.is_symlink()
    if not existed:
        _write_new(policy, "#!/bin/sh\nexit 101\n", 0o755)
    try:
        yield
    finally:
        if not existed:
            policy.unlink(missing_ok=True)


def _mkdirs(root: Path, path: str) -> Path:
    """`path` of the image created as directories, resolved inside the root first: what is missing of the
    resolved path has no link in it to follow (in_root followed every one that exists)."""
    resolved = in_root(root, path)
    resolved.mkdir(parents=True, exist_ok=True)
    return resolved


def _write_new(path: Path, text: str, mode: int = 0o644) -> None:
    """Write `path` (its directory already resolved in the image), never through a link at the name itself."""
    if path.is_symlink():
        path.unlink()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, mode)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(path, mode, follow_symlinks=False)


# --- the work in the chroot -----------------------------------------------------------------------------


def _check_names(packages: list[str]) -> None:
    bad = [p for p in packages if not _PACKAGE.match(p)]
    if bad:
        raise CustomiseError(f"invalid_package_name: {', '.join(bad)}")


_NOT_FOUND = (
    re.compile(r"^E: Unable to locate package (\S+)", re.M),
    re.compile(r"^E: Package '([^']+)' has no installation candidate", re.M),
    re.compile(r"^E: Version '[^']+' for '([^']+)' was not found", re.M),
)


# What the image's own programs keep of root (bwrap --cap-add; everything else dropped, and bwrap's securebits
# keep an exec from getting it back): owning, chmod-ing and setuid-ing files and dropping to apt's _apt user.
# No CAP_SYS_ADMIN (no mount), no CAP_MKNOD (no device node for a host disk), no CAP_SYS_RAWIO/MODULE/PTRACE.
_SANDBOX_CAPS = (
    "CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_DAC_READ_SEARCH", "CAP_FOWNER", "CAP_FSETID",
    "CAP_SETUID", "CAP_SETGID", "CAP_SETFCAP", "CAP_KILL",
)  # fmt: skip


def sandbox_argv(root: Path, *, network: bool) -> list[str]:
    """bwrap (Debian package bubblewrap) around a command of the image: the image's root is / (pivot_root, so
    there is no way back to the host's tree, as there is from a chroot), a fresh /dev with no disk in it, a
    proc of its own pid namespace, no /sys, fresh ipc/uts/cgroup namespaces; the network only where
    `network` (apt's downloads), never for a maintainer script. Every process dies with the sandbox.

    No user namespace: dpkg gives files to the image's own users, and a user namespace mapping only root
    would refuse that; the capability set above is what keeps the image's root from the host instead."""
    caps = [arg for cap in _SANDBOX_CAPS for arg in ("--cap-add", cap)]
    return [
        "bwrap", "--die-with-parent", "--new-session",
        "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
        *([] if network else ["--unshare-net"]),
        "--cap-drop", "ALL", *caps,
        # /tmp sticky and world-writable, as apt (dropped to _apt) and package scripts expect it.
        "--bind", str(root), "/", "--dev", "/dev", "--proc", "/proc", "--perms", "1777", "--tmpfs", "/tmp",
        "--tmpfs", "/run",
        "--chdir", "/", "--clearenv",
        *[arg for k, v in _CHROOT_ENV.items() for arg in ("--setenv", k, v)],
        "--",
    ]  # fmt: skip


async def _in_chroot(root: Path, *argv: str, network: bool = False) -> tuple[int, str, str]:
    if not shutil.which("bwrap"):
        raise CustomiseError("chroot_unavailable: bwrap is not installed (Debian package bubblewrap)")
    return await _exec(*sandbox_argv(root, network=network), *argv, env=_CHROOT_ENV)


async def install(root: Path, packages: list[str]) -> None:
    """apt in the sandbox: the index and the packages downloaded with the network, then installed (the
    maintainer scripts run) without it."""
    rc, out, err = await _in_chroot(root, "apt-get", "update", network=True)
    if rc != 0:
        raise CustomiseError(f"apt_update_failed: {(err or out).strip().splitlines()[-1:]}")
    if packages:
        argv = ["apt-get", "install", "-y", "--no-install-recommends", "-o", "Dpkg::Options::=--force-confold"]
        for phase in ("download", "install"):
            extra = ["--download-only"] if phase == "download" else []
            rc, out, err = await _in_chroot(root, *argv, *extra, *packages, network=phase == "download")
            if rc != 0:
                missing = [m for pattern in _NOT_FOUND for m in pattern.findall(err)]
                if missing:
                    raise CustomiseError(f"package_not_in_archive: {', '.join(sorted(set(missing)))}")
                last = (err or out).strip().splitlines()[-1:] or ["(no output)"]
                raise CustomiseError(f"apt_install_failed: {last[0][:500]}")


def write_readiness_unit(root: Path) -> None:
    """The unit and the report script, written on the host side: each directory resolved in the image (an
    image's absolute link at etc/systemd means its own root, not the host's), each file opened without
    following a link at its name."""
    script_dir = _mkdirs(root, str(Path(GPU_REPORT_SCRIPT).parent))
    _write_new(script_dir / Path(GPU_REPORT_SCRIPT).name, gpu_report_source(), 0o755)
    units = _mkdirs(root, "etc/systemd/system")
    _write_new(units / READY_UNIT, READY_UNIT_TEXT)
    wants = _mkdirs(root, "etc/systemd/system/multi-user.target.wants")
    link = wants / READY_UNIT
    link.unlink(missing_ok=True)
    link.symlink_to(f"/etc/systemd/system/{READY_UNIT}")


def _clean(root: Path) -> None:
    """apt's caches emptied and the machine's identity cleared, every path resolved in the image: a link at
    var/cache/apt/archives to a host directory must not have the host's files deleted."""
    for d in ("var/cache/apt/archives", "var/lib/apt/lists"):
        base = in_root(root, d)
        if not base.is_dir():
            continue
        for p in base.iterdir():
            if p.is_symlink() or p.is_file():
                p.unlink()
            elif p.name == "partial" and p.is_dir():
                shutil.rmtree(p, ignore_errors=True)  # rmtree never follows links inside the tree
    cache = in_root(root, "var/cache/apt")
    for name in ("pkgcache.bin", "srcpkgcache.bin"):
        (cache / name).unlink(missing_ok=True)
    # Every clone is its own machine: its id and (when cloud-init makes new ones at first boot) its SSH host
    # keys must not come from the build.
    machine_id = in_root(root, "etc", follow_last=True) / "machine-id"
    if machine_id.exists() or machine_id.is_symlink():
        _write_new(machine_id, "", 0o444)
    if in_root(root, "usr/bin/cloud-init").exists():
        ssh = in_root(root, "etc/ssh")
        if ssh.is_dir():
            for key in ssh.glob("ssh_host_*"):
                key.unlink()


async def customise_root(root: Path, packages: list[str], stamp: dict) -> None:
    # No host /dev, /sys or /proc is mounted into the image: the sandbox (sandbox_argv) brings its own.
    async with no_service_starts(root), host_resolver(root):
        await install(root, packages)
    await asyncio.to_thread(write_readiness_unit, root)
    blob = json.dumps({**stamp, "packages": packages}, sort_keys=True, indent=2) + "\n"
    stamp_dir = await asyncio.to_thread(in_root, root, str(Path(STAMP_PATH).parent))
    await asyncio.to_thread(_write_new, stamp_dir / Path(STAMP_PATH).name, blob)
    await asyncio.to_thread(_clean, root)


# --- reading a built image back -------------------------------------------------------------------------


def parse_dpkg_status(text: str) -> dict[str, tuple[str, str]]:
    """package -> (status, version) from var/lib/dpkg/status."""
    found: dict[str, tuple[str, str]] = {}
    for stanza in text.split("\n\n"):
        fields: dict[str, str] = {}
        for line in stanza.splitlines():
            if line and not line[0].isspace() and ":" in line:
                key, _, value = line.partition(":")
                fields[key] = value.strip()
        if "Package" in fields:
            found[fields["Package"]] = (fields.get("Status", ""), fields.get("Version", ""))
    return found


async def installed_versions(raw: Path, packages: list[str], workdir: Path) -> dict[str, str]:
    """The installed version of each package, read from the raw image's dpkg database with the image
    mounted read-only; package_missing_after_build unless every one is `install ok installed`."""
    root_part = await asyncio.to_thread(find_root, raw)
    target = workdir / f"readback-{uuid.uuid4().hex[:8]}"
    async with loop_device(raw, root_part, read_only=True) as dev, mounted(dev, target, "-o", "ro,noload"):
        status = await asyncio.to_thread((target / "var/lib/dpkg/status").read_text, errors="replace")
    await asyncio.to_thread(target.rmdir)
    db = parse_dpkg_status(status)
    versions, missing = {}, []
    for spec in packages:
        name = spec.split("=", 1)[0].split(":", 1)[0]
        state, version = db.get(name, ("", ""))
        if state == "install ok installed":
            versions[name] = version
        else:
            missing.append(f"{name} ({state or 'absent'})")
    if missing:
        raise CustomiseError(f"package_missing_after_build: {', '.join(missing)}")
    return versions


# --- the plug-in ----------------------------------------------------------------------------------------


def pick_method() -> str:
    root = os.geteuid() == 0
    if root and Path("/dev/nbd0").exists() and shutil.which("qemu-nbd") and shutil.which("losetup"):
        return "nbd"
    if root and Path("/dev/loop-control").exists() and shutil.which("losetup"):
        return "loop"
    if shutil.which("virt-customize"):
        return "virt-customize"
    lacking = []
    if not root:
        lacking.append("root (loop and nbd need it)")
    if not Path("/dev/loop-control").exists():
        lacking.append("/dev/loop-control (loop module)")
    if not shutil.which("losetup"):
        lacking.append("losetup (util-linux)")
    lacking.append("virt-customize (libguestfs-tools)")
    raise CustomiseError("chroot_unavailable: no way to open the image, missing " + ", ".join(lacking))


class ChrootCustomiser:
    name = "chroot"
    # The build reads the package database back from the artifact and records the versions.
    installs_packages = True

    def plan(self, image: Path, packages: list[str]) -> list[str]:
        try:
            method = pick_method()
        except CustomiseError as exc:
            return [f"fails: {exc}"]
        pkgs = " ".join(packages)
        if method == "virt-customize":
            return VirtCustomizeCustomiser().plan(image, packages)
        if method == "nbd":
            opened = [f"qemu-nbd --connect /dev/nbdN {image}", "losetup --offset <root partition> /dev/nbdN"]
        else:
            raw = image.with_suffix(".chroot.raw")
            opened = [f"qemu-img convert -O raw -S 4k {image} {raw}", f"losetup --offset <root partition> {raw}"]
        return [
            *opened,
            "mount the root; host resolv.conf; policy-rc.d",
            "in bwrap (the root as /, its own /dev and proc, no /sys, capabilities cut): apt-get update, "
            f"apt-get install --download-only {pkgs}, then without network apt-get install -y "
            f"--no-install-recommends {pkgs}",
            f"install {READY_UNIT} (multi-user.target.wants) and /{GPU_REPORT_SCRIPT}, write /{STAMP_PATH}, apt clean",
            "unmount, detach" + (f", qemu-img convert -O qcow2 back to {image}" if method == "loop" else ""),
        ]

    async def customise(self, image: Path, packages: list[str], stamp: dict) -> None:
        _check_names(packages)
        method = pick_method()
        if method == "virt-customize":
            await VirtCustomizeCustomiser().customise(image, packages, stamp)
            return
        # The build's own qcow2 copy (every customiser is given one), opened as qcow2: never probed.
        fmt = "qcow2"
        mnt = image.parent / f"chroot-{uuid.uuid4().hex[:8]}"
        if method == "nbd":
            async with nbd_device(image, fmt) as disk:
                await self._on_disk(disk, mnt, packages, stamp)
            return
        raw = image.with_suffix(".chroot.raw")
        try:
            await convert_to_raw(image, fmt, raw)
            await self._on_disk(raw, mnt, packages, stamp)
            back = image.with_name(image.name + ".part")
            await _must("qemu-img", "convert", "-f", "raw", "-O", fmt, str(raw), str(back))
            await asyncio.to_thread(back.replace, image)
        finally:
            await asyncio.to_thread(raw.unlink, missing_ok=True)

    async def _on_disk(self, disk: Path, mnt: Path, packages: list[str], stamp: dict) -> None:
        part = await asyncio.to_thread(find_root, disk)
        try:
            async with loop_device(disk, part) as dev, mounted(dev, mnt, "-t", "ext4"):
                await customise_root(mnt, packages, stamp)
        finally:
            # Left in place only when something is still mounted on it, which the error above reports.
            with contextlib.suppress(OSError):
                await asyncio.to_thread(mnt.rmdir)


CUSTOMISERS[ChrootCustomiser.name] = ChrootCustomiser()
