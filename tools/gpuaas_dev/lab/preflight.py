"""What the lab needs from this machine, checked before anything is made.

A machine without a piece gets one line naming it and the Debian package that brings it (`scripts/setup.sh`
installs them all), never a traceback half-way through a start.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from dataclasses import dataclass
from pathlib import Path

# OVMF with 4 MiB flash, as Debian's `ovmf` ships it; the agent's domain XML names the same files.
OVMF_CODE = Path("/usr/share/OVMF/OVMF_CODE_4M.fd")
OVMF_VARS = Path("/usr/share/OVMF/OVMF_VARS_4M.fd")


class LabUnavailable(RuntimeError):
    """The lab cannot run on this machine; the message is one line that says what is missing."""


@dataclass(frozen=True)
class Requirement:
    what: str  # an executable on PATH, or an absolute file path
    package: str  # the Debian package that provides it

    def present(self) -> bool:
        if self.what.startswith("/"):
            return Path(self.what).exists()
        return shutil.which(self.what) is not None


REQUIREMENTS = (
    Requirement("qemu-system-x86_64", "qemu-system-x86"),
    Requirement("qemu-img", "qemu-utils"),
    Requirement("libvirtd", "libvirt-daemon-system"),
    Requirement("virtlogd", "libvirt-daemon-system"),
    Requirement("virsh", "libvirt-clients"),
    Requirement("virt-xml-validate", "libvirt-clients"),
    Requirement("dnsmasq", "dnsmasq-base"),
    Requirement(str(OVMF_CODE), "ovmf"),
    Requirement(str(OVMF_VARS), "ovmf"),
    Requirement("ip", "iproute2"),
    Requirement("socat", "socat"),
    Requirement("dhcp_release", "dnsmasq-utils"),
    Requirement("iptables", "iptables"),
    Requirement("losetup", "mount"),
    Requirement("blkdiscard", "util-linux"),
    Requirement("wipefs", "util-linux"),
    Requirement("ssh", "openssh-client"),
    Requirement("ssh-keygen", "openssh-client"),
    Requirement("mmdebstrap", "mmdebstrap"),
    Requirement("grub-mkimage", "grub-efi-amd64-bin"),
    Requirement("mkfs.vfat", "dosfstools"),
)


def missing_requirements() -> list[Requirement]:
    return [r for r in REQUIREMENTS if not r.present()]


def installed() -> bool:
    """Every piece the lab needs is on this machine (it may still fail to work: then the lab must fail)."""
    return not missing_requirements()


def _other_libvirtd() -> int | None:
    """The pid of a libvirtd already running: a second system-mode daemon would fight it over
    /run/libvirt, so the lab refuses rather than share one whose guests live outside its namespace."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if (entry / "comm").read_text().strip() == "libvirtd":
                return int(entry.name)
        except OSError:
            continue
    return None


def can_make_namespace() -> str | None:
    """None when this process may make a network namespace, else why not (one line)."""
    if os.geteuid() != 0:
        return "the lab needs root (network namespaces, loop devices, libvirt's system daemon)"
    name = f"gpuaas-probe-{uuid.uuid4().hex[:8]}"
    made = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot make a network namespace: {made.stderr.strip() or made.returncode}"
    subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return None


def check() -> None:
    """Raise LabUnavailable with one line when the lab cannot start here."""
    missing = missing_requirements()
    if missing:
        names = ", ".join(f"{r.what} (Debian package {r.package})" for r in missing)
        raise LabUnavailable(f"the lab needs {names}: run scripts/setup.sh")
    if not Path("/dev/loop-control").exists():
        raise LabUnavailable("the lab needs loop devices (/dev/loop-control is missing)")
    why = can_make_namespace()
    if why:
        raise LabUnavailable(why)
    pid = _other_libvirtd()
    if pid is not None:
        raise LabUnavailable(f"a libvirtd already runs (pid {pid}); the lab starts its own inside its namespace")
