"""A Debian 12 base disk image built from Debian packages: the lab's stand-in for the Ubuntu cloud image
production starts from.

The image is what a vendor publishes, no more: a GPT disk with an EFI system partition (GRUB, made on the
build host) and an ext4 root labelled `gpuaas-root`. cloud-init, sshd and the guest agent are left out on
purpose; the image pipeline's customiser installs them, which is what the lab exercises.

Built once per recipe into a content-addressed cache (`<cache>/<recipe hash>/`) with a `SHA256SUMS` beside
the qcow2, so the pipeline can fetch it over loopback from "a URL with a published checksum list".

    python -m gpuaas_dev.lab.base_image [--cache-dir DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import fcntl
import functools
import hashlib
import http.server
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import threading
import uuid
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

# Bumped whenever the way the image is made changes, so a cached image of the old recipe is not reused.
BUILDER_VERSION = "2"
SUITE = "bookworm"
IMAGE_NAME = "debian-12-lab-base.qcow2"
ROOT_LABEL = "gpuaas-root"
ESP_LABEL = "GPUAAS-ESP"
PACKAGES = (
    "linux-image-cloud-amd64",
    "initramfs-tools",
    "systemd-sysv",
    "udev",
    "ifupdown",
    "isc-dhcp-client",
    "netbase",
    "iproute2",
    "sudo",
    # cloud-init's locale module fails on an image without it, and then reports the whole run as an error.
    "locales",
    "e2fsprogs",
    "ca-certificates",
    # The system bus: without it systemd-logind does not run, nothing acts on the ACPI power button, and a
    # graceful stop of the VM can only end in a hard one. Every cloud image has it.
    "dbus",
)
ESP_MIB = 64
DISK_GIB = 3
# Only what the embedded GRUB needs to find the root by label on a GPT disk and start Linux over serial.
GRUB_MODULES = (
    "part_gpt",
    "fat",
    "ext2",
    "normal",
    "linux",
    "search",
    "search_label",
    "configfile",
    "echo",
    "serial",
    "terminal",
    "efi_gop",
    "all_video",
    "gzio",
    "test",
    "boot",
)

SECTOR = 512
_ESP_TYPE = uuid.UUID("c12a7328-f81f-11d2-ba4b-00a0c93ec93b")
_LINUX_ROOT_X86_64 = uuid.UUID("4f68bce3-e8cd-4db1-96e7-fbcaf984b709")


class BaseImageError(RuntimeError):
    pass


@dataclass(frozen=True)
class BaseImage:
    path: Path
    sha256: str
    sums_path: Path


def default_cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "gpuaas" / "lab-images"


def recipe_hash() -> str:
    recipe = {
        "builder": BUILDER_VERSION,
        "suite": SUITE,
        "variant": "minbase",
        "packages": sorted(PACKAGES),
        "grub_modules": sorted(GRUB_MODULES),
        "esp_mib": ESP_MIB,
        "disk_gib": DISK_GIB,
        "root_label": ROOT_LABEL,
    }
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:24]


def read_sums(sums: Path, name: str) -> str | None:
    for line in sums.read_text().splitlines():
        digest, _, entry = line.partition("  ")
        if entry.lstrip("*") == name:
            return digest
    return None


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


async def ensure_base_image(cache_dir: Path | None = None, *, log: Callable[[str], None] | None = None) -> BaseImage:
    """The cached base image of the current recipe, built first when the cache has none."""
    return await asyncio.to_thread(build_base_image, cache_dir or default_cache_dir(), log or (lambda _m: None))


def _cached(entry: Path) -> BaseImage | None:
    image, sums = entry / IMAGE_NAME, entry / "SHA256SUMS"
    if not (image.is_file() and sums.is_file()):
        return None
    digest = read_sums(sums, IMAGE_NAME)
    return BaseImage(image, digest, sums) if digest else None


def build_base_image(cache_dir: Path, log: Callable[[str], None]) -> BaseImage:
    entry = cache_dir / recipe_hash()
    if found := _cached(entry):
        return found
    cache_dir.mkdir(parents=True, exist_ok=True)
    # Two test sessions (or a test and the CLI) asking at once build it once: the second waits here and then
    # finds the first one's entry.
    with (cache_dir / f".{entry.name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if found := _cached(entry):
            return found
        _require_tools()
        work = Path(tempfile.mkdtemp(prefix=f".build-{entry.name}-", dir=cache_dir))
        try:
            out = work / "out"
            out.mkdir()
            _build(work, out / IMAGE_NAME, log)
            digest = sha256_file(out / IMAGE_NAME)
            (out / "SHA256SUMS").write_text(f"{digest}  {IMAGE_NAME}\n")
            # The entry appears whole or not at all: a build that fails or is killed leaves only its
            # scratch directory, which is no cache entry.
            out.rename(entry)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    found = _cached(entry)
    assert found is not None
    return found


def _require_tools() -> None:
    needed = {
        "mmdebstrap": "mmdebstrap",
        "mkfs.ext4": "e2fsprogs",
        "mkfs.vfat": "dosfstools",
        "mcopy": "mtools",
        "grub-mkimage": "grub-efi-amd64-bin",
        "qemu-img": "qemu-utils",
    }
    missing = [f"{tool} (Debian package {pkg})" for tool, pkg in needed.items() if not shutil.which(tool)]
    if not Path("/usr/lib/grub/x86_64-efi").is_dir():
        missing.append("/usr/lib/grub/x86_64-efi (Debian package grub-efi-amd64-bin)")
    if missing:
        raise BaseImageError("cannot build the lab base image, missing: " + ", ".join(missing))
    if os.geteuid() != 0:
        raise BaseImageError("building the lab base image needs root (mmdebstrap makes device nodes, owners)")


def _sh(*argv: str | Path, **kw) -> None:
    proc = subprocess.run([str(a) for a in argv], stdin=subprocess.DEVNULL, capture_output=True, text=True, **kw)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout)[-3000:]
        raise BaseImageError(f"{Path(str(argv[0])).name} failed ({proc.returncode}): {tail}")


def _build(work: Path, image: Path, log: Callable[[str], None]) -> None:
    rootfs = work / "rootfs"
    log(f"mmdebstrap {SUITE} into {rootfs}")
    _sh(
        "mmdebstrap",
        "--variant=minbase",
        "--mode=root",
        f"--include={','.join(PACKAGES)}",
        # Kernel and initrd links in /boot, where the GRUB config names them, kept current by every kernel
        # package the customiser may later install.
        '--setup-hook=mkdir -p "$1/etc" && printf "link_in_boot = yes\\n" > "$1/etc/kernel-img.conf"',
        # Debian's locale-gen ignores the locale cloud-init names and builds only what locale.gen lists, so
        # without this cloud-init's locale module fails and the whole run reports an error.
        '--customize-hook=echo "en_US.UTF-8 UTF-8" > "$1/etc/locale.gen" && chroot "$1" locale-gen',
        '--customize-hook=rm -f "$1"/var/cache/apt/archives/*.deb',
        SUITE,
        rootfs,
    )
    _configure_rootfs(rootfs)
    esp = work / "esp.img"
    make_esp(esp, work, GRUB_CFG)

    raw = work / "disk.raw"
    total = DISK_GIB << 30
    esp_start = 1 << 20
    root_start = esp_start + (ESP_MIB << 20)
    # The backup GPT takes the last 33 sectors; the root ends on a MiB boundary before them.
    root_end = (total - 34 * SECTOR) // (1 << 20) * (1 << 20)
    with raw.open("wb") as f:
        f.truncate(total)
    write_gpt(
        raw,
        [
            (_ESP_TYPE, esp_start, esp_start + (ESP_MIB << 20), "EFI System"),
            (_LINUX_ROOT_X86_64, root_start, root_end, "root"),
        ],
    )
    copy_into(esp, raw, esp_start)
    log("mkfs.ext4 -d: root filesystem from the tree")
    _sh(
        "mkfs.ext4",
        "-F",
        "-q",
        "-L",
        ROOT_LABEL,
        "-d",
        rootfs,
        "-E",
        f"offset={root_start}",
        raw,
        f"{(root_end - root_start) // 1024}k",
    )
    log(f"qemu-img convert -> {image}")
    _sh("qemu-img", "convert", "-f", "raw", "-O", "qcow2", raw, image)


def _configure_rootfs(rootfs: Path) -> None:
    etc = rootfs / "etc"
    (etc / "fstab").write_text(
        f"LABEL={ROOT_LABEL} / ext4 errors=remount-ro 0 1\n"
        # No fsck pass for the ESP: the image has no fsck.vfat (dosfstools), and a failing check holds the mount.
        f"LABEL={ESP_LABEL} /boot/efi vfat umask=0077,nofail,x-systemd.device-timeout=10s 0 0\n"
    )
    (rootfs / "boot" / "efi").mkdir(parents=True, exist_ok=True)
    (etc / "hostname").write_text("debian\n")
    (etc / "hosts").write_text("127.0.0.1 localhost\n127.0.1.1 debian\n::1 localhost ip6-localhost ip6-loopback\n")
    (etc / "network" / "interfaces.d").mkdir(parents=True, exist_ok=True)
    # cloud-init renders the guest's NICs into interfaces.d; until it does, only loopback is configured.
    (etc / "network" / "interfaces").write_text(
        "source /etc/network/interfaces.d/*\n\nauto lo\niface lo inet loopback\n"
    )
    # A machine id per booted guest, not one baked into every clone of the image.
    (etc / "machine-id").write_text("")
    dbus_id = rootfs / "var" / "lib" / "dbus" / "machine-id"
    if dbus_id.exists() or dbus_id.is_symlink():
        dbus_id.unlink()
    boot = rootfs / "boot"
    for link, prefix in (("vmlinuz", "vmlinuz-"), ("initrd.img", "initrd.img-")):
        if not (boot / link).exists():
            found = sorted(p.name for p in boot.glob(prefix + "*"))
            if not found:
                raise BaseImageError(f"the tree has no /boot/{prefix}*: the kernel package did not install")
            (boot / link).unlink(missing_ok=True)
            (boot / link).symlink_to(found[-1])


def _grub_image(work: Path) -> Path:
    out = work / "BOOTX64.EFI"
    # The prefix has no device: GRUB reads its config from the partition it was loaded from.
    _sh(
        "grub-mkimage",
        "-O",
        "x86_64-efi",
        "-p",
        "/EFI/BOOT",
        "-o",
        out,
        *GRUB_MODULES,
    )
    return out


GRUB_CFG = f"""\
serial --unit=0 --speed=115200
terminal_input serial console
terminal_output serial console
set timeout=1
search --no-floppy --label --set=root {ROOT_LABEL}
menuentry "Debian 12 (gpuaas lab base)" {{
    linux /boot/vmlinuz root=LABEL={ROOT_LABEL} rw console=tty0 console=ttyS0
    initrd /boot/initrd.img
}}
"""


def make_esp(esp: Path, work: Path, grub_cfg: str) -> None:
    """An EFI system partition image (FAT32, ESP_MIB) holding GRUB as the removable-media loader
    (EFI/BOOT/BOOTX64.EFI, what firmware without boot entries runs) and `grub_cfg` beside it."""
    boot_efi = _grub_image(work)
    _sh("mkfs.vfat", "-C", "-F", "32", "-n", ESP_LABEL, esp, str(ESP_MIB * 1024))
    cfg = work / "grub.cfg"
    cfg.write_text(grub_cfg)
    env = {**os.environ, "MTOOLS_SKIP_CHECK": "1"}
    _sh("mmd", "-i", esp, "::/EFI", "::/EFI/BOOT", env=env)
    _sh("mcopy", "-i", esp, boot_efi, "::/EFI/BOOT/BOOTX64.EFI", env=env)
    _sh("mcopy", "-i", esp, cfg, "::/EFI/BOOT/grub.cfg", env=env)


def copy_into(src: Path, disk: Path, offset: int) -> None:
    with src.open("rb") as fin, disk.open("r+b") as fout:
        fout.seek(offset)
        while chunk := fin.read(1 << 20):
            if chunk.count(0) == len(chunk):
                fout.seek(len(chunk), os.SEEK_CUR)  # keep the hole
            else:
                fout.write(chunk)


def write_gpt(disk: Path, parts: list[tuple[uuid.UUID, int, int, str]]) -> None:
    """A GPT (protective MBR, primary and backup header and entry arrays) for partitions given as
    (type, start byte, end byte exclusive, name). Written here because the lab machines have no sfdisk."""
    size = disk.stat().st_size
    last_lba = size // SECTOR - 1
    entries = bytearray(128 * 128)
    for i, (ptype, start, end, name) in enumerate(parts):
        struct.pack_into(
            "<16s16sQQQ72s",
            entries,
            i * 128,
            ptype.bytes_le,
            uuid.uuid4().bytes_le,
            start // SECTOR,
            end // SECTOR - 1,
            0,
            name.encode("utf-16-le"),
        )
    entries_crc = zlib.crc32(entries)
    disk_guid = uuid.uuid4().bytes_le

    def header(current: int, backup: int, entries_lba: int) -> bytes:
        fields = (b"EFI PART", 0x00010000, 92, 0, 0, current, backup, 34, last_lba - 33, disk_guid)
        h = (
            struct.pack("<8sIIIIQQQQ16s", *fields)
            + struct.pack("<QII", entries_lba, 128, 128)
            + struct.pack("<I", entries_crc)
        )
        crc = zlib.crc32(h)
        return (h[:16] + struct.pack("<I", crc) + h[20:]).ljust(SECTOR, b"\0")

    mbr = bytearray(SECTOR)
    struct.pack_into("<B3sB3sII", mbr, 446, 0, b"\x00\x02\x00", 0xEE, b"\xff\xff\xff", 1, min(last_lba, 0xFFFFFFFF))
    mbr[510:512] = b"\x55\xaa"
    with disk.open("r+b") as f:
        f.write(mbr)
        f.write(header(1, last_lba, 2))
        f.write(entries)
        f.seek((last_lba - 32) * SECTOR)
        f.write(entries)
        f.write(header(last_lba, 1, last_lba - 32))


# --- serving it ---------------------------------------------------------------------------------------


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass


def serve_directory(directory: Path) -> tuple[str, Callable[[], None]]:
    """Serve a directory over HTTP on a free loopback port, from a thread; the base URL (ending in `/`) and
    the function that stops it."""
    handler = functools.partial(_QuietHandler, directory=str(directory))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, name="lab-http", daemon=True)
    thread.start()

    def stop() -> None:
        server.shutdown()
        server.server_close()
        thread.join()

    host, port = server.server_address[:2]
    return f"http://{host}:{port}/", stop


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gpuaas_dev.lab.base_image", description=__doc__.split("\n")[0])
    parser.add_argument("--cache-dir", type=Path, default=None, help=f"default {default_cache_dir()}")
    args = parser.parse_args(argv)
    try:
        image = asyncio.run(ensure_base_image(args.cache_dir, log=lambda m: print(m, file=sys.stderr)))
    except BaseImageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(image.path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
