"""NVMe disks: controllers, namespaces (with native-multipath hidden paths), partitions, the disk stand-ins
under /dev and their by-id links."""

from __future__ import annotations

import struct

from .description import MIB, HostDescription
from .tree import _symlink, _Sysfs, _write


def write_nvme(fs: _Sysfs, desc: HostDescription, mounts: list[str]) -> None:
    """Write every disk of `desc`, appending the mounts of mounted disks and partitions to `mounts`."""
    root = fs.root
    sysroot = fs.sys
    dev = root / "dev"
    for disk in desc.nvme:
        ctrl_dir = fs.pci(
            disk.pci_address,
            [f"0000:{int(disk.pci_address.split(':')[1], 16) - 1:02x}:01.0"],
            vendor="144d",
            device="a80a",
            cls="0x010802",
            numa=disk.numa_node,
            driver="nvme",
            iommu=desc.iommu_groups,
        )
        name = f"nvme{disk.ctrl}n1"
        nvme_ctrl = ctrl_dir / "nvme" / f"nvme{disk.ctrl}"
        _write(nvme_ctrl / "serial", disk.serial + "\n")
        _write(nvme_ctrl / "model", disk.model + "\n")
        _symlink(nvme_ctrl / "device", ctrl_dir)
        _symlink(sysroot / "class/nvme" / f"nvme{disk.ctrl}", nvme_ctrl)
        if disk.multipath_hidden_paths:
            # Native multipath: the namespace head is virtual, the per-controller path is hidden.
            head = sysroot / "devices/virtual/nvme-subsystem" / f"nvme-subsys{disk.ctrl}" / name
            hidden_name = f"nvme{disk.ctrl}c{disk.ctrl}n1"
            hidden = nvme_ctrl / hidden_name
            for attr, value in (("hidden", "1"), ("size", str(disk.size_bytes // 512)), ("wwid", disk.wwid)):
                _write(hidden / attr, value + "\n")
            _symlink(sysroot / "block" / hidden_name, hidden)
            _symlink(sysroot / "class/block" / hidden_name, hidden)
            _symlink(head / "device", sysroot / "devices/virtual/nvme-subsystem" / f"nvme-subsys{disk.ctrl}")
        else:
            head = nvme_ctrl / name
            _symlink(head / "device", nvme_ctrl)
        for attr, value in (
            ("hidden", "0"),
            ("size", str(disk.size_bytes // 512)),
            ("wwid", disk.wwid),
            ("removable", "0"),
            ("ro", "0"),
        ):
            _write(head / attr, value + "\n")
        (head / "holders").mkdir(parents=True, exist_ok=True)
        _symlink(sysroot / "block" / name, head)
        _symlink(sysroot / "class/block" / name, head)

        path = dev / name
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            with path.open("wb") as f:
                f.truncate(desc.disk_file_bytes)
                if disk.dos_label:
                    f.seek(446)
                    f.write(bytes([0, 0, 0, 0, 0x83, 0, 0, 0]) + struct.pack("<II", 2048, 4096))
                    f.seek(510)
                    f.write(b"\x55\xaa")
        by_id = dev / "disk/by-id"
        _symlink(by_id / f"nvme-{disk.wwid}", path)
        _symlink(by_id / f"nvme-{disk.model.replace(' ', '_')}_{disk.serial}", path)
        _symlink(by_id / f"nvme-{disk.model.replace(' ', '_')}_{disk.serial}_1", path)
        if disk.mountpoint:
            mounts.append(f"/dev/{name} {disk.mountpoint} ext4 rw,relatime 0 0")
        for part in disk.partitions:
            pname = f"{name}p{part.number}"
            _write(head / pname / "partition", f"{part.number}\n")
            _write(head / pname / "size", "2048\n")
            _symlink(sysroot / "class/block" / pname, head / pname)
            ppath = dev / pname
            if not ppath.exists():
                with ppath.open("wb") as f:
                    f.truncate(MIB)
            _symlink(by_id / f"nvme-{disk.wwid}-part{part.number}", ppath)
            if part.mountpoint:
                mounts.append(f"/dev/{pname} {part.mountpoint} {part.fstype} rw,relatime 0 0")
