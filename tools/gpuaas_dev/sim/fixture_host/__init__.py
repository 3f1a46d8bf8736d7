"""Generated host roots: the sysfs, /dev, /proc and /etc of a described slice host, plus the few host tools
the agent runs (as tiny scripts answering from the description).

Tests build their hosts with it and the simulated fleet gives every simulated host one, so discovery, parity
and the disk preflight read the same layout a Dell XE9680L presents (see the host facts reference):
`/sys/bus/pci/devices` entries are relative symlinks into a PCIe-switch hierarchy, `driver` and `iommu_group`
are symlinks, NVMe disks are named by volatile kernel names and found by stable by-id links, native
multipath adds hidden `nvmeXcYnZ` nodes, and disk stand-ins under /dev are regular files.

One module per part: description (the models and stock hosts), tree (file, symlink and sysfs writers), pci
(GPUs and NICs), nvme (disks), system (/dev, modules, hugepages, /proc, /etc and the host tools).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from .description import (
    GPU_BUSES,
    GPU_MODULES,
    MIB,
    Gpu,
    HostDescription,
    Nic,
    NvmeDisk,
    Partition,
    describe_fleet_node,
    eui_for,
    fleet_bridge_cidr,
    xe9680l,
)
from .nvme import write_nvme
from .pci import write_gpus, write_nics
from .system import write_etc, write_host_tools, write_kernel
from .tree import FIXTURE_DATA, _Sysfs


def build_host_root(root: str | os.PathLike[str], desc: HostDescription) -> Path:
    """Write the host tree under `root`. Rebuilding an existing root refreshes /sys, /proc and /etc but keeps
    the disk stand-ins' contents: a simulated host keeps its disks across an agent restart."""
    root = Path(root)
    for generated in ("sys", "proc", FIXTURE_DATA, "dev/disk/by-id"):
        shutil.rmtree(root / generated, ignore_errors=True)
    fs = _Sysfs(root)
    sysroot = fs.sys
    if desc.iommu_groups:
        (sysroot / "kernel/iommu_groups").mkdir(parents=True, exist_ok=True)

    write_gpus(fs, desc)
    write_nics(fs, desc)
    mounts = [
        "sysfs /sys sysfs rw,nosuid,nodev,noexec,relatime 0 0",
        "proc /proc proc rw,nosuid,nodev,noexec,relatime 0 0",
        "tmpfs /run tmpfs rw,nosuid,nodev,size=52428800k,mode=755 0 0",
    ]
    write_nvme(fs, desc, mounts)
    write_kernel(fs, desc, mounts)
    write_etc(root, desc)
    write_host_tools(fs, desc)
    return root


__all__ = [
    "FIXTURE_DATA",
    "GPU_BUSES",
    "GPU_MODULES",
    "MIB",
    "Gpu",
    "HostDescription",
    "Nic",
    "NvmeDisk",
    "Partition",
    "build_host_root",
    "describe_fleet_node",
    "eui_for",
    "fleet_bridge_cidr",
    "xe9680l",
]
