"""Topology discovery from a host root: GPUs, fabric functions and NVMe disks, and candidate slots.

Read-only. Follows the PCI symlinks into the switch hierarchy, names disks by their stable by-id link, skips
hidden multipath paths, and never offers the OS disk or a disk that is (or has a child partition) mounted.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass, field

from gpuaas_common.contract import messages as m
from gpuaas_common.contract import utcnow
from gpuaas_common.logging import get_logger

from ..domain.gpu_modules import fabric_mode, fabric_version, mapping_problems, parse_module_ids
from ..domain.topology import DiskRef, GpuRef, VfRef, emulated_candidates, pair_candidates
from .host import Host, HostFs

log = get_logger(__name__)

_BDF = re.compile(r"^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")
_DISK = re.compile(r"^nvme(\d+)n(\d+)$")
OS_MOUNTPOINTS = frozenset({"/", "/boot", "/boot/efi", "/usr", "/var", "[SWAP]"})
# Identity links derived from the namespace's WWID, in order of preference; model/serial links are not unique
# enough across vendors and `-part` links name partitions.
_STABLE_PREFIXES = ("nvme-eui.", "nvme-uuid.", "nvme-nvme.")


def _int(text: str | None, base: int = 10) -> int | None:
    if text is None:
        return None
    try:
        return int(text, base)
    except ValueError:
        return None


def _numa(text: str | None) -> int | None:
    value = _int(text)
    return None if value is None or value < 0 else value


def _hex4(text: str | None) -> str:
    return (text or "").lower().removeprefix("0x").zfill(4)[-4:]


# --- PCI ---------------------------------------------------------------------------------------------


@dataclass
class PciInfo:
    bdf: str
    path: str
    vendor: str
    device: str
    cls: str
    numa_node: int | None
    iommu_group: int | None
    driver: str | None
    pcie_switch: str | None


def pci_devices(fs: HostFs) -> dict[str, PciInfo]:
    out: dict[str, PciInfo] = {}
    for bdf in fs.listdir("/sys/bus/pci/devices"):
        if not _BDF.match(bdf):
            continue
        # Entries are symlinks on real hosts (a lab agent that only accepted directories found no GPUs).
        path = fs.realpath(f"/sys/bus/pci/devices/{bdf}")
        bridges = [c for c in path.split("/") if _BDF.match(c)][:-1]
        group = fs.link_name(f"{path}/iommu_group")
        out[bdf] = PciInfo(
            bdf=bdf,
            path=path,
            vendor=_hex4(fs.read(f"{path}/vendor")),
            device=_hex4(fs.read(f"{path}/device")),
            cls=(fs.read(f"{path}/class") or "").lower(),
            numa_node=_numa(fs.read(f"{path}/numa_node")),
            iommu_group=_int(group),
            driver=fs.link_name(f"{path}/driver"),
            # root port → switch upstream port → downstream port → device
            pcie_switch=bridges[-2] if len(bridges) >= 3 else None,
        )
    return out


def _pci_fields(info: PciInfo) -> dict[str, object]:
    return {
        "pci_address": info.bdf,
        "vendor_id": info.vendor,
        "device_id": info.device,
        "numa_node": info.numa_node,
        "iommu_group": info.iommu_group,
        "driver": info.driver,
        "pcie_switch": info.pcie_switch,
    }


def gpus(devices: dict[str, PciInfo]) -> list[m.GpuDevice]:
    return [
        m.GpuDevice(**_pci_fields(d))
        for d in devices.values()  # type: ignore[arg-type]
        if d.vendor == "10de" and d.cls.startswith("0x0302")
    ]


def fabric(fs: HostFs, devices: dict[str, PciInfo]) -> list[m.FabricDevice]:
    ib_by_pci: dict[str, tuple[str, str | None, str | None]] = {}
    for ib in fs.listdir("/sys/class/infiniband"):
        dev_path = fs.realpath(f"/sys/class/infiniband/{ib}/device")
        ib_path = fs.realpath(f"/sys/class/infiniband/{ib}")
        ib_by_pci[dev_path.rsplit("/", 1)[-1]] = (
            ib,
            fs.read(f"{ib_path}/ports/1/state"),
            fs.read(f"{ib_path}/ports/1/link_layer"),
        )
    out = []
    for d in devices.values():
        if d.vendor != "15b3" or not d.cls.startswith("0x02"):
            continue
        physfn = fs.realpath(f"{d.path}/physfn").rsplit("/", 1)[-1] if fs.exists(f"{d.path}/physfn") else None
        ib = ib_by_pci.get(d.bdf)
        out.append(
            m.FabricDevice(
                **_pci_fields(d),  # type: ignore[arg-type]
                role="vf" if physfn else "pf",
                physfn=physfn,
                sriov_totalvfs=_int(fs.read(f"{d.path}/sriov_totalvfs")),
                sriov_numvfs=_int(fs.read(f"{d.path}/sriov_numvfs")),
                ib_device=ib[0] if ib else None,
                ib_port_state=ib[1] if ib else None,
                link_layer=ib[2] if ib else None,
            )
        )
    return out


# --- NVLink module IDs and Fabric Manager -------------------------------------------------------------

FABRICMANAGER_CFG = "/usr/share/nvidia/nvswitch/fabricmanager.cfg"
FABRICMANAGER_UNIT = "nvidia-fabricmanager"


async def module_ids(host: Host) -> tuple[dict[str, int], list[str]]:
    """PCI address -> module ID from `nvidia-smi -q`, and the problems met. No nvidia-smi (a lab host, a host
    image without the driver tools) is no map at all, not a problem: such a host is placed without partitions."""
    if host.run.which("nvidia-smi") is None:
        return {}, []
    res = await host.run.run("nvidia-smi", "-q")
    if not res.ok:
        return {}, [f"nvidia-smi -q failed (rc {res.rc}): {res.stderr[:200]}"]
    return parse_module_ids(res.stdout)


async def fabric_manager(host: Host) -> m.FabricManagerInfo | None:
    """None on a host without Fabric Manager installed (neither its config nor its binary)."""
    binary = host.run.which("nv-fabricmanager")
    cfg = host.fs.read_raw(FABRICMANAGER_CFG)
    if binary is None and cfg is None:
        return None
    version = None
    if binary is not None:
        res = await host.run.run("nv-fabricmanager", "--version")
        version = fabric_version(res.stdout + "\n" + res.stderr) if res.ok else None
    unit = await host.run.run("systemctl", "is-active", FABRICMANAGER_UNIT)
    return m.FabricManagerInfo(
        mode=fabric_mode(cfg),  # type: ignore[arg-type]
        version=version,
        active=unit.ok and unit.stdout.strip() == "active",
    )


# --- block devices -----------------------------------------------------------------------------------


def mount_table(fs: HostFs) -> dict[str, list[str]]:
    """Kernel block device name → mountpoints (swap counts as mounted)."""
    out: dict[str, list[str]] = {}

    def add(source: str, where: str) -> None:
        if source.startswith("/dev/"):
            name = fs.realpath(source).rsplit("/", 1)[-1]
            out.setdefault(name, []).append(where)

    for line in (fs.read_raw("/proc/mounts") or "").splitlines():
        fields = line.split()
        if len(fields) >= 2:
            # /proc/mounts escapes blanks in paths as \040
            add(fields[0], fields[1].replace("\\040", " "))
    for line in (fs.read_raw("/proc/swaps") or "").splitlines()[1:]:
        fields = line.split()
        if fields:
            add(fields[0], "[SWAP]")
    return out


@dataclass
class BlockUse:
    """How a whole disk is in use on the host right now."""

    name: str
    exists: bool
    hidden: bool = False
    partitions: list[str] = field(default_factory=list)
    holders: list[str] = field(default_factory=list)
    mountpoints: list[str] = field(default_factory=list)
    child_mounts: dict[str, list[str]] = field(default_factory=dict)

    @property
    def is_os_disk(self) -> bool:
        every = self.mountpoints + [mp for mps in self.child_mounts.values() for mp in mps]
        return any(mp in OS_MOUNTPOINTS for mp in every)

    def refusal(self) -> tuple[str, str] | None:
        """(reason_code, reason) when the disk must not be written, None when it is free."""
        if not self.exists:
            return "disk_missing", f"{self.name} is not a block device on this host"
        if self.hidden:
            return "disk_hidden_path", f"{self.name} is a hidden multipath path"
        if self.is_os_disk:
            return "disk_is_os_disk", f"{self.name} holds the operating system"
        if self.mountpoints:
            return "disk_mounted", f"{self.name} is mounted at {', '.join(self.mountpoints)}"
        if self.child_mounts:
            detail = ", ".join(f"{c} at {', '.join(mps)}" for c, mps in sorted(self.child_mounts.items()))
            return "disk_child_mounted", f"{self.name} has mounted child partitions: {detail}"
        if self.holders:
            return "disk_in_use", f"{self.name} is held by {', '.join(self.holders)}"
        return None


def block_use(fs: HostFs, name: str, mounts: dict[str, list[str]] | None = None) -> BlockUse:
    sys_path = f"/sys/class/block/{name}"
    if not fs.exists(sys_path) and not fs.exists(f"/sys/block/{name}"):
        return BlockUse(name=name, exists=False)
    mounts = mount_table(fs) if mounts is None else mounts
    head = fs.realpath(f"/sys/block/{name}") if fs.exists(f"/sys/block/{name}") else fs.realpath(sys_path)
    if fs.read(f"{head}/partition") is not None:
        # A partition is never a slot disk: its parent and siblings are someone's data.
        return BlockUse(name=name, exists=True, mountpoints=["(partition of another disk)"], hidden=False)
    use = BlockUse(name=name, exists=True, hidden=fs.read(f"{head}/hidden") == "1")
    use.partitions = [c for c in fs.listdir(head) if c.startswith(name) and fs.read(f"{head}/{c}/partition")]
    use.holders = fs.listdir(f"{head}/holders")
    use.mountpoints = list(mounts.get(name, []))
    for child in use.partitions + use.holders:
        if mounts.get(child):
            use.child_mounts[child] = list(mounts[child])
        for holder in fs.listdir(f"{head}/{child}/holders"):
            if mounts.get(holder):
                use.child_mounts[holder] = list(mounts[holder])
    return use


def stable_ids(fs: HostFs) -> dict[str, str]:
    """Kernel name → preferred stable /dev/disk/by-id path of that whole disk."""
    best: dict[str, tuple[int, str]] = {}
    for entry in fs.listdir("/dev/disk/by-id"):
        if "-part" in entry:
            continue
        rank = next((i for i, p in enumerate(_STABLE_PREFIXES) if entry.startswith(p)), None)
        if rank is None:
            continue
        name = fs.realpath(f"/dev/disk/by-id/{entry}").rsplit("/", 1)[-1]
        path = f"/dev/disk/by-id/{entry}"
        if name not in best or (rank, path) < best[name]:
            best[name] = (rank, path)
    return {name: path for name, (_, path) in best.items()}


async def signatures(host: Host, name: str) -> list[str] | None:
    if host.run.which("wipefs") is None:
        return None
    res = await host.run.run("wipefs", "--json", str(host.fs.agent_path(f"/dev/{name}")))
    if res.rc != 0:
        return None
    if not res.stdout.strip():
        return []
    try:
        return [f"{s.get('type') or 'unknown'}@{s.get('offset')}" for s in json.loads(res.stdout)["signatures"]]
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


async def nvme_disks(host: Host, *, leased_by_id: Iterable[str] = ()) -> list[m.NvmeDevice]:
    fs = host.fs
    leased = set(leased_by_id)
    mounts = mount_table(fs)
    ids = stable_ids(fs)
    out = []
    for name in fs.listdir("/sys/block"):
        match = _DISK.match(name)
        if not match:
            continue  # hidden per-path nodes nvmeXcYnZ and everything that is not an NVMe namespace
        head = fs.realpath(f"/sys/block/{name}")
        if fs.read(f"{head}/hidden") == "1":
            continue
        numa = _numa(fs.read(f"/sys/class/nvme/nvme{match.group(1)}/device/numa_node"))
        out.append(await _disk_evidence(host, name, ids.get(name), mounts, leased, numa=numa))
    return sorted(out, key=lambda d: (d.by_id or "~", d.kernel_name))


async def emulated_slot_disks(
    host: Host, by_ids: Iterable[str], *, leased_by_id: Iterable[str] = ()
) -> list[m.NvmeDevice]:
    """The disks a site declared as emulated slots (the lab's loop devices behind by-id links), with the same
    evidence an NVMe namespace gets: mounted, held, OS disk, signatures. A declared link that resolves to no
    block device has no entry here; `discover` names it as a blocker."""
    fs = host.fs
    leased = set(leased_by_id)
    mounts = mount_table(fs)
    out = []
    for by_id in sorted(set(by_ids)):
        name = fs.realpath(by_id).rsplit("/", 1)[-1]
        if block_use(fs, name, mounts).exists:
            out.append(await _disk_evidence(host, name, by_id, mounts, leased))
    return out


async def _disk_evidence(
    host: Host,
    name: str,
    by_id: str | None,
    mounts: dict[str, list[str]],
    leased: set[str],
    *,
    numa: int | None = None,
) -> m.NvmeDevice:
    """What discovery says of one whole disk: how it is used, its signatures, and why it cannot be a slot's
    (a signature on a disk this agent leased is its tenant's data, not a reason to exclude it)."""
    use = block_use(host.fs, name, mounts)
    sigs = await signatures(host, name)
    reason = use.refusal()
    excluded = reason[0].removeprefix("disk_") if reason else None
    if excluded is None and by_id is None:
        excluded = "no_stable_id"
    if excluded is None and sigs and by_id not in leased:
        excluded = "signatures_present"
    fs = host.fs
    head = fs.realpath(f"/sys/block/{name}") if fs.exists(f"/sys/block/{name}") else f"/sys/class/block/{name}"
    size = _int(fs.read(f"{head}/size")) or 0
    return m.NvmeDevice(
        kernel_name=name,
        by_id=by_id,
        size_bytes=size * 512,
        numa_node=numa,
        mounted=bool(use.mountpoints),
        mountpoints=use.mountpoints,
        mounted_children=sorted(use.child_mounts),
        is_os_disk=use.is_os_disk,
        signatures=sigs,
        candidate=excluded is None,
        excluded_reason=excluded,
    )


# --- network -----------------------------------------------------------------------------------------


async def interface_addresses(host: Host) -> dict[str, list[str]]:
    """Interface → IPv4 CIDRs from `ip -j addr show`; empty when the tool is missing or fails."""
    res = await host.run.run("ip", "-j", "addr", "show")
    if not res.ok:
        return {}
    try:
        links = json.loads(res.stdout or "[]")
        return {
            link["ifname"]: [
                f"{a['local']}/{a['prefixlen']}" for a in link.get("addr_info", []) if a.get("family") == "inet"
            ]
            for link in links
        }
    except (ValueError, KeyError, TypeError):
        return {}


# --- hugepages -----------------------------------------------------------------------------------------

HUGEPAGES_1G_DIR = "/sys/kernel/mm/hugepages/hugepages-1048576kB"
HUGEPAGES_1G_TOTAL = f"{HUGEPAGES_1G_DIR}/nr_hugepages"
HUGEPAGES_1G_FREE = f"{HUGEPAGES_1G_DIR}/free_hugepages"


def hugepages_1g(fs: HostFs) -> tuple[int | None, int | None]:
    """(total, free) 1 GiB hugepages. A kernel without a 1 GiB pool has no directory for it: (0, 0), the
    host has none. A file that is there but unreadable gives None: unknown, which placement treats as none."""
    if not fs.exists(HUGEPAGES_1G_DIR):
        return 0, 0

    def count(path: str) -> int | None:
        value = _int(fs.read(path))
        return value if value is not None and value >= 0 else None

    return count(HUGEPAGES_1G_TOTAL), count(HUGEPAGES_1G_FREE)


# --- the whole report ---------------------------------------------------------------------------------


async def discover(
    host: Host,
    node_id: str,
    *,
    task_id: str | None = None,
    ovs_bridge: str = "ovsbr0",
    leased_by_id: Iterable[str] = (),
    emulated_disks: Iterable[str] = (),
) -> m.NodeTopologyReported:
    devices = pci_devices(host.fs)
    modules, module_problems = await module_ids(host)
    gpu_list = [g.model_copy(update={"module_id": modules.get(g.pci_address)}) for g in gpus(devices)]
    fabric_list = fabric(host.fs, devices)
    disks = await nvme_disks(host, leased_by_id=leased_by_id)
    emulated = await emulated_slot_disks(host, emulated_disks, leased_by_id=leased_by_id)
    blockers: list[str] = list(module_problems)
    blockers += mapping_problems(
        [g.pci_address for g in gpu_list], {g.pci_address: g.module_id for g in gpu_list if g.module_id}
    )
    bridge_cidrs = (await interface_addresses(host)).get(ovs_bridge, [])
    if not bridge_cidrs:
        blockers.append(f"OVS bridge {ovs_bridge} has no IPv4 address; suggested IPs assume 10.100.0.1/24")
    candidates = pair_candidates(
        node_id,
        [GpuRef(g.pci_address, g.numa_node, g.pcie_switch) for g in gpu_list],
        [DiskRef(d.by_id, d.numa_node) for d in disks if d.candidate and d.by_id],
        [VfRef(f.pci_address, f.numa_node) for f in fabric_list if f.role == "vf"],
        ovs_bridge=ovs_bridge,
        bridge_cidr=bridge_cidrs[0] if bridge_cidrs else "10.100.0.1/24",
    )
    candidates += emulated_candidates(
        node_id,
        [d.by_id for d in emulated if d.candidate and d.by_id],
        first_index=len(candidates),
        ovs_bridge=ovs_bridge,
        bridge_cidr=bridge_cidrs[0] if bridge_cidrs else "10.100.0.1/24",
    )
    for by_id in sorted(set(emulated_disks) - {d.by_id for d in emulated}):
        blockers.append(f"emulated slot disk {by_id} is not a block device on this host")
    for d in emulated:
        if not d.candidate:
            blockers.append(f"emulated slot disk {d.by_id} is not free: {d.excluded_reason}")
    slots = []
    for c in candidates:
        slots.append(
            m.CandidateSlot(
                index=c.index,
                gpu_pci_address=c.gpu.pci_address if c.gpu else None,
                emulated=c.emulated,
                numa_node=c.gpu.numa_node if c.gpu else None,
                pcie_switch=c.gpu.pcie_switch if c.gpu else None,
                module_id=modules.get(c.gpu.pci_address) if c.gpu else None,
                nvme_by_id=c.nvme_by_id,
                fabric_claim_mode="none" if c.emulated else "per_slot_vf",
                fabric_vf_pci_address=c.fabric_vf,
                mac=c.mac,
                private_ip=c.private_ip,
                ovs_bridge=c.ovs_bridge,
                ovs_port=c.ovs_port,
                complete=not c.missing,
                missing=c.missing,
            )
        )
        if c.missing and c.gpu:
            blockers.append(f"GPU {c.gpu.pci_address} has no free {' or '.join(c.missing)}")
    for g in gpu_list:
        if g.iommu_group is None:
            blockers.append(f"GPU {g.pci_address} is in no IOMMU group")
    hugepages_total, hugepages_free = hugepages_1g(host.fs)
    report = m.NodeTopologyReported(
        node_id=node_id,
        task_id=task_id,
        discovered_at=utcnow(),
        gpus=gpu_list,
        fabric=fabric_list,
        nvme=disks + emulated,
        candidate_slots=slots,
        blockers=blockers,
        hugepages_1g_total=hugepages_total,
        hugepages_1g_free=hugepages_free,
        fabric_manager=await fabric_manager(host),
    )
    log.info(
        "topology_discovered",
        node_id=node_id,
        task_id=task_id,
        gpus=len(gpu_list),
        fabric=len(fabric_list),
        nvme=len(disks),
        candidates=sum(s.complete for s in slots),
        blockers=len(blockers),
        module_ids=len(modules),
        fabric_manager_mode=report.fabric_manager.mode if report.fabric_manager else None,
        hugepages_1g_total=hugepages_total,
        hugepages_1g_free=hugepages_free,
    )
    return report
