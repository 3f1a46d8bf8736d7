"""PCI devices in sysfs: GPUs behind their PCIe switches, ConnectX/BlueField NICs with their VFs."""

from __future__ import annotations

from .description import HostDescription
from .tree import _symlink, _Sysfs, _write

# Root port bus per PCIe switch: two GPUs behind each of four switches, two switches per NUMA node.
_SWITCH_ROOT_BUS = (0x15, 0x37, 0x97, 0xB7)


def write_gpus(fs: _Sysfs, desc: HostDescription) -> None:
    # GPUs behind PCIe switches: root port → switch upstream port → downstream port → GPU.
    downstream_slot: dict[int, int] = {}
    for index, gpu in enumerate(desc.gpus):
        rb = _SWITCH_ROOT_BUS[gpu.switch % len(_SWITCH_ROOT_BUS)]
        slot = downstream_slot.get(gpu.switch, 0)
        downstream_slot[gpu.switch] = slot + 1
        chain = [f"0000:{rb:02x}:01.0", f"0000:{rb + 1:02x}:00.0", f"0000:{rb + 2:02x}:{slot:02x}.0"]
        fs.pci(
            gpu.pci_address,
            chain,
            vendor="10de",
            device=gpu.device_id,
            cls="0x030200",
            numa=gpu.numa_node,
            driver="nvidia" if index < desc.nvidia_bound_gpus else gpu.driver,
            iommu=desc.iommu_groups,
        )


def write_nics(fs: _Sysfs, desc: HostDescription) -> None:
    sysroot = fs.sys
    for nic in desc.nics:
        bus = int(nic.pci_address.split(":")[1], 16)
        chain = [f"0000:{bus - 2:02x}:01.0"]
        pf = fs.pci(
            nic.pci_address,
            chain,
            vendor="15b3",
            device=nic.device_id,
            cls="0x020700" if nic.link_layer == "InfiniBand" else "0x020000",
            numa=nic.numa_node,
            driver="mlx5_core",
            iommu=desc.iommu_groups,
        )
        _write(pf / "sriov_totalvfs", f"{nic.totalvfs}\n")
        _write(pf / "sriov_numvfs", f"{nic.numvfs}\n")
        _write(pf / "sriov_vf_device", f"{nic.vf_device_id}\n")
        base = nic.pci_address[:-1]
        for n in range(nic.numvfs):
            vf_bdf = f"{base}{n + 1}"
            vf = fs.pci(
                vf_bdf,
                chain,
                vendor="15b3",
                device=nic.vf_device_id,
                cls="0x020700",
                numa=nic.numa_node,
                driver=nic.vf_driver,
                iommu=desc.iommu_groups,
            )
            _symlink(pf / f"virtfn{n}", vf)
            _symlink(vf / "physfn", pf)
        if nic.ib_device:
            ib = pf / "infiniband" / nic.ib_device
            _write(ib / "ports/1/state", nic.port_state + "\n")
            _write(ib / "ports/1/link_layer", nic.link_layer + "\n")
            _symlink(ib / "device", pf)
            _symlink(sysroot / "class/infiniband" / nic.ib_device, ib)
        if nic.device_id == "a2dc" and nic.pci_address.endswith(".0"):
            # The BF3 SoC management function: a DMA controller, not a fabric device.
            fs.pci(
                f"{base}2",
                chain,
                vendor="15b3",
                device="c2d5",
                cls="0x080100",
                numa=nic.numa_node,
                driver=None,
                iommu=desc.iommu_groups,
            )
