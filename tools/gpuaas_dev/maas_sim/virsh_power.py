"""The `virsh` power driver: a simulated MAAS machine that is a real QEMU guest on a libvirt daemon.

MAAS drives machines that are virtual machines through exactly this driver (power type `virsh`, parameters
`power_address` = the libvirt URI and `power_id` = the domain). Opt-in per machine; a machine without it keeps
the timer-driven simulation.

Deploy does MAAS's part and nothing of the product's: curtin's install of the deployed boot resource (the tgz the
gateway uploaded) onto the machine's disk in the `flat` layout of a UEFI machine (an EFI system partition and one
root partition; curtin refuses a root tree without its `/curtin` marker, with MAAS's message) with GRUB as its
bootloader, configured as update-grub would from the image's /etc/default/grub (its kernel arguments); the
user-data handed over as a NoCloud seed built from exactly the bytes the deploy carried; then power on. The machine
boots through its firmware (OVMF) from its own disk: GRUB finds the root by label and loads the image's kernel and
initrd. What stays out is MAAS's PXE phase (the ephemeral environment curtin runs in): the simulator writes the disk
from outside. Release powers the machine off (`virsh destroy`, as MAAS's driver does) and, with erase, wipes the
disk and checks no signature is left.
"""

from __future__ import annotations

import asyncio
import io
import re
import shlex
import shutil
import subprocess
import uuid
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pycdlib

ROOT_LABEL = "gpuaas-root"
# curtin's root markers (the runbook's troubleshooting quotes the error).
CURTIN_MARKERS = ("curtin", "system-data/var/lib/snapd", "snaps")
QUICK_ERASE_BYTES = 2 << 20  # MAAS's quick erase: 2 MiB at the start and the end of each disk
_LINUX_ROOT_X86_64 = uuid.UUID("4f68bce3-e8cd-4db1-96e7-fbcaf984b709")
_ISO_NAMES = {"user-data": "/USERDATA.;1", "meta-data": "/METADATA.;1"}


class PowerFailed(RuntimeError):
    """The step failed; the message is what MAAS would put in the machine's status message."""


@dataclass(frozen=True)
class VirshParams:
    power_address: str  # libvirt URI
    power_id: str  # domain name
    disk: str  # the machine's disk (a file), what erase wipes
    work_dir: str  # firmware variables, seed and console log: must be readable by QEMU's unprivileged user
    bridge: str
    mac_address: str
    memory_mib: int = 1024
    disk_gib: int = 4

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> VirshParams:
        fields = set(cls.__dataclass_fields__)
        unknown = set(data) - fields
        if unknown:
            raise ValueError(f"unknown virsh power parameters: {sorted(unknown)}")
        return cls(**data)


def _run(*argv: str | Path) -> str:
    proc = subprocess.run([str(a) for a in argv], capture_output=True, text=True)
    if proc.returncode != 0:
        raise PowerFailed(f"{Path(str(argv[0])).name} failed: {(proc.stderr or proc.stdout).strip()[-400:]}")
    return proc.stdout


def seed_iso(user_data: bytes, meta_data: bytes) -> bytes:
    iso = pycdlib.PyCdlib()
    iso.new(interchange_level=3, joliet=3, rock_ridge="1.09", vol_ident="cidata")
    for name, data in (("user-data", user_data), ("meta-data", meta_data)):
        iso.add_fp(io.BytesIO(data), len(data), _ISO_NAMES[name], rr_name=name, joliet_path=f"/{name}")
    out = io.BytesIO()
    iso.write_fp(out)
    iso.close()
    return out.getvalue()


def _grub_args(tree: Path) -> list[str]:
    """The kernel arguments the image staged for GRUB (GRUB_CMDLINE_LINUX and _DEFAULT, quoted values only)."""
    grub = tree / "etc/default/grub"
    args: list[str] = []
    if grub.is_file():
        for key in ("GRUB_CMDLINE_LINUX", "GRUB_CMDLINE_LINUX_DEFAULT"):
            m = re.search(rf'^{key}="([^"$`]*)"', grub.read_text(errors="replace"), re.M)
            if m:
                args += [a for a in shlex.split(m.group(1)) if a not in args and a not in ("quiet", "splash")]
    return args


def _boot_file(tree: Path, name: str) -> Path:
    path = tree / "boot" / name
    if path.is_symlink():
        target = Path(str(path.readlink()))
        path = tree / target.relative_to("/") if target.is_absolute() else path.parent / target
    if not path.is_file():
        raise PowerFailed(f"Failed deployment: installing-kernel: the image has no /boot/{name}")
    return path


def grub_cfg(cmdline: list[str]) -> str:
    """What update-grub writes for the installed image, cut to one entry: the root by label, its kernel and
    initrd (the image's /boot links), its arguments."""
    return (
        "serial --unit=0 --speed=115200\nterminal_input serial console\nterminal_output serial console\n"
        f"set timeout=1\nsearch --no-floppy --label --set=root {ROOT_LABEL}\n"
        f'menuentry "gpuaas deployed image" {{\n    linux /boot/vmlinuz {" ".join(cmdline)}\n'
        "    initrd /boot/initrd.img\n}\n"
    )


def install(params: VirshParams, tgz: bytes) -> list[str]:
    """curtin's part: the root tree onto the disk (flat layout, UEFI: ESP + root) with GRUB. Returns the kernel
    command line GRUB boots."""
    from ..lab.base_image import _ESP_TYPE, ESP_LABEL, ESP_MIB, copy_into, make_esp, write_gpt

    work = Path(params.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    tree = work / "target"
    archive = work / "root-tgz"
    shutil.rmtree(tree, ignore_errors=True)
    tree.mkdir()
    try:
        archive.write_bytes(tgz)
        _run("tar", "-xzpf", archive, "-C", tree, "--numeric-owner")
        if not any((tree / marker).exists() for marker in CURTIN_MARKERS):
            raise PowerFailed(
                "Failed deployment: Did not find any filesystem on ['/dev/vda'] that contained one of "
                f"{list(CURTIN_MARKERS)}"
            )
        (tree / "boot/efi").mkdir(parents=True, exist_ok=True)
        # The ESP waits for its device for up to 2 minutes: a TCG guest on a loaded machine saw its label appear
        # after the 10 s it was given once, and booted without /boot/efi (nofail: the boot itself never waits on it).
        (tree / "etc/fstab").write_text(
            f"LABEL={ROOT_LABEL} / ext4 errors=remount-ro 0 1\n"
            f"LABEL={ESP_LABEL} /boot/efi vfat umask=0077,nofail,x-systemd.device-timeout=120s 0 0\n"
        )
        for name in ("vmlinuz", "initrd.img"):
            _boot_file(tree, name)  # curtin fails the same way on an image without a kernel
        cmdline = [f"root=LABEL={ROOT_LABEL}", "ro", "console=ttyS0", *_grub_args(tree)]
        esp = work / "esp.img"
        make_esp(esp, work, grub_cfg(cmdline))
        disk = Path(params.disk)
        size = params.disk_gib << 30
        with disk.open("wb") as f:
            f.truncate(size)
        esp_start = 1 << 20
        start, end = esp_start + (ESP_MIB << 20), (size - 34 * 512) // (1 << 20) * (1 << 20)
        write_gpt(
            disk,
            [(_ESP_TYPE, esp_start, start, "EFI System"), (_LINUX_ROOT_X86_64, start, end, "root")],
        )
        copy_into(esp, disk, esp_start)
        _run(
            "mkfs.ext4",
            "-F",
            "-q",
            "-L",
            ROOT_LABEL,
            "-d",
            tree,
            "-E",
            f"offset={start}",
            disk,
            f"{(end - start) // 1024}k",
        )
    finally:
        shutil.rmtree(tree, ignore_errors=True)
        archive.unlink(missing_ok=True)
        for leftover in ("esp.img", "grub.cfg", "BOOTX64.EFI"):
            (work / leftover).unlink(missing_ok=True)
    return cmdline


def domain_xml(params: VirshParams) -> str:
    """A UEFI machine that boots from its disk: OVMF, its variables in the work directory (made from Debian's
    template by libvirt at the first start)."""
    from ..lab.preflight import OVMF_CODE, OVMF_VARS

    work = Path(params.work_dir)

    def sub(parent: ET.Element, tag: str, text: str | None = None, **attrs: str) -> ET.Element:
        el = ET.SubElement(parent, tag, attrs)
        if text is not None:
            el.text = text
        return el

    root = ET.Element("domain", type="qemu")
    sub(root, "name", params.power_id)
    sub(root, "memory", str(params.memory_mib), unit="MiB")
    sub(root, "vcpu", "1")
    os_el = sub(root, "os")
    sub(os_el, "type", "hvm", arch="x86_64", machine="q35")
    sub(os_el, "loader", str(OVMF_CODE), readonly="yes", secure="no", type="pflash")
    sub(os_el, "nvram", str(work / "OVMF_VARS.fd"), template=str(OVMF_VARS))
    sub(os_el, "boot", dev="hd")
    features = sub(root, "features")
    sub(features, "acpi")
    sub(features, "apic")
    sub(root, "cpu", mode="maximum", check="none", migratable="off")
    sub(root, "on_poweroff", "destroy")
    sub(root, "on_reboot", "restart")
    devices = sub(root, "devices")
    disk = sub(devices, "disk", type="file", device="disk")
    sub(disk, "driver", name="qemu", type="raw", discard="unmap")
    sub(disk, "source", file=params.disk)
    sub(disk, "target", dev="vda", bus="virtio")
    # Cloud kernels see CDs on virtio-scsi only (no AHCI driver).
    sub(devices, "controller", type="scsi", index="0", model="virtio-scsi")
    seed = sub(devices, "disk", type="file", device="cdrom")
    sub(seed, "driver", name="qemu", type="raw")
    sub(seed, "source", file=str(work / "seed.iso"))
    sub(seed, "target", dev="sda", bus="scsi")
    sub(seed, "readonly")
    nic = sub(devices, "interface", type="bridge")
    sub(nic, "mac", address=params.mac_address)
    sub(nic, "source", bridge=params.bridge)
    sub(nic, "model", type="virtio")
    serial = sub(devices, "serial", type="pty")
    sub(serial, "log", file=str(work / "console.log"), append="off")
    sub(serial, "target", port="0")
    console = sub(devices, "console", type="pty")
    sub(console, "target", type="serial", port="0")
    return ET.tostring(root, encoding="unicode")


def power_off(params: VirshParams) -> None:
    state = subprocess.run(
        ["virsh", "-c", params.power_address, "domstate", params.power_id], capture_output=True, text=True
    )
    if state.returncode == 0 and state.stdout.strip() not in ("shut off", ""):
        _run("virsh", "-c", params.power_address, "destroy", params.power_id)


def power_state(params: VirshParams) -> str:
    state = subprocess.run(
        ["virsh", "-c", params.power_address, "domstate", params.power_id], capture_output=True, text=True
    )
    return "on" if state.returncode == 0 and state.stdout.strip() == "running" else "off"


def deploy(params: VirshParams, tgz: bytes, user_data: bytes | None, system_id: str, hostname: str) -> None:
    power_off(params)
    # Firmware variables of an earlier deploy name a disk layout that is gone: each deploy starts from the template.
    (Path(params.work_dir) / "OVMF_VARS.fd").unlink(missing_ok=True)
    install(params, tgz)
    # The bytes the gateway sent, unchanged: the seed is how they reach the machine.
    meta = f"instance-id: {system_id}\nlocal-hostname: {hostname}\n".encode()
    iso = Path(params.work_dir) / "seed.iso"
    iso.write_bytes(seed_iso(user_data or b"", meta))
    iso.chmod(0o644)
    xml = Path(params.work_dir) / "domain.xml"
    xml.write_text(domain_xml(params))
    _run("virsh", "-c", params.power_address, "define", xml)
    _run("virsh", "-c", params.power_address, "start", params.power_id)


def release(params: VirshParams, erase_mode: str | None) -> None:
    power_off(params)
    if erase_mode is None:
        return
    disk = Path(params.disk)
    size = disk.stat().st_size if disk.exists() else params.disk_gib << 30
    if erase_mode == "quick":
        with disk.open("r+b") as f:
            f.write(b"\0" * QUICK_ERASE_BYTES)
            f.seek(max(0, size - QUICK_ERASE_BYTES))
            f.write(b"\0" * QUICK_ERASE_BYTES)
    else:
        with disk.open("r+b") as f:
            f.truncate(0)  # every byte reads zero again; the file stays sparse
            f.truncate(size)
    probe = subprocess.run(["blkid", "-p", str(disk)], capture_output=True, text=True)
    if probe.returncode != 2:  # 2: nothing found
        raise PowerFailed(f"Failed disk erasing: a signature is left on the disk: {probe.stdout.strip()[:200]}")


async def run(fn: Any, *args: Any) -> None:
    await asyncio.to_thread(fn, *args)
