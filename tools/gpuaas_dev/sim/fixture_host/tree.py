"""Writing the tree: files, relative symlinks, the fixture's tool scripts, and PCI devices in sysfs."""

from __future__ import annotations

import os
import stat
from pathlib import Path

FIXTURE_DATA = "var/lib/gpuaas-fixture"


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def _symlink(link: Path, target: Path) -> None:
    """A relative symlink, as sysfs and udev make them."""
    link.parent.mkdir(parents=True, exist_ok=True)
    if link.is_symlink() or link.exists():
        link.unlink()
    os.symlink(os.path.relpath(target, link.parent), link)


def _script(path: Path, body: str) -> None:
    _write(path, "#!/bin/sh\n" + 'DATA="$(cd "$(dirname "$0")/../.." && pwd)/' + FIXTURE_DATA + '"\n' + body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)


class _Sysfs:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.sys = root / "sys"
        self.next_group = 10

    def pci(
        self,
        bdf: str,
        chain: list[str],
        *,
        vendor: str,
        device: str,
        cls: str,
        numa: int,
        driver: str | None,
        iommu: bool,
    ) -> Path:
        domain, bus = bdf.split(":")[0], bdf.split(":")[1]
        root_bus = chain[0].split(":")[1] if chain else bus
        d = self.sys / "devices" / f"pci{domain}:{root_bus}"
        for bridge in chain:
            d = d / bridge
            if not (d / "class").exists():
                for name, value in (
                    ("vendor", "0x8086"),
                    ("device", "0x352a"),
                    ("class", "0x060400"),
                    ("numa_node", str(numa)),
                ):
                    _write(d / name, value + "\n")
        d = d / bdf
        for name, value in (
            ("vendor", f"0x{vendor}"),
            ("device", f"0x{device}"),
            ("class", cls),
            ("numa_node", str(numa)),
            ("driver_override", "(null)"),
            ("uevent", f"DRIVER={driver or ''}\nPCI_ID={vendor.upper()}:{device.upper()}\nPCI_SLOT_NAME={bdf}"),
        ):
            _write(d / name, value + "\n")
        _symlink(self.sys / "bus/pci/devices" / bdf, d)
        if driver:
            drv = self.sys / "bus/pci/drivers" / driver
            drv.mkdir(parents=True, exist_ok=True)
            _symlink(d / "driver", drv)
            _symlink(drv / bdf, d)
        if iommu:
            group = self.sys / "kernel/iommu_groups" / str(self.next_group)
            self.next_group += 1
            _symlink(d / "iommu_group", group)
            _symlink(group / "devices" / bdf, d)
        return d
