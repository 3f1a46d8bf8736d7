"""The rest of the host: /dev/kvm and vfio, kernel modules, hugepages, /proc, /etc, and the data and scripts
behind the `ip`, `iptables` and `systemctl` the agent runs."""

from __future__ import annotations

import ipaddress
import json
import os
import shutil
from pathlib import Path

from .description import HostDescription
from .tree import FIXTURE_DATA, _script, _Sysfs, _write

FABRIC_IF = "ibp24s0"


def write_kernel(fs: _Sysfs, desc: HostDescription, mounts: list[str]) -> None:
    """/dev/kvm and vfio, loaded modules, hugepages and /proc (its mounts are `mounts`)."""
    root = fs.root
    sysroot = fs.sys
    dev = root / "dev"
    if desc.kvm:
        _write(dev / "kvm", "")
    elif (dev / "kvm").exists():
        (dev / "kvm").unlink()
    (dev / "vfio").mkdir(parents=True, exist_ok=True)
    _write(dev / "vfio/vfio", "")

    modules = ["kvm", "kvm_intel", "mlx5_core", "nvme", "openvswitch"]
    if desc.vfio_modules:
        modules += ["vfio", "vfio_pci", "vfio_iommu_type1"]
    for module in modules:
        _write(sysroot / "module" / module / "refcnt", "0\n")

    hp = sysroot / "kernel/mm/hugepages/hugepages-1048576kB"
    if desc.hugepages_1g_total is None:
        shutil.rmtree(hp, ignore_errors=True)
    else:
        _write(hp / "nr_hugepages", f"{desc.hugepages_1g_total}\n")
        _write(hp / "free_hugepages", f"{min(desc.hugepages_1g_free, desc.hugepages_1g_total)}\n")
    _write(sysroot / "kernel/mm/hugepages/hugepages-2048kB/free_hugepages", "0\n")

    proc = root / "proc"
    _write(proc / "mounts", "\n".join(mounts) + "\n")
    _write(proc / "swaps", "Filename\t\t\t\tType\t\tSize\t\tUsed\t\tPriority\n")
    _write(proc / "cmdline", "BOOT_IMAGE=/vmlinuz root=UUID=0 ro intel_iommu=on iommu=pt\n")
    _write(proc / "sys/net/ipv4/ip_forward", "1\n" if desc.ip_forward else "0\n")
    _write(proc / "sys/kernel/hostname", desc.hostname + "\n")


DRIVERCTL_DIR = "etc/driverctl.d"
H200_IB_DONE = "var/lib/gpuaas/site-bootstrap/h200-ib.done"
REBOOT_REQUIRED = "var/run/reboot-required"
FABRICMANAGER_CFG = "usr/share/nvidia/nvswitch/fabricmanager.cfg"


def _vfio_devices(desc: HostDescription) -> list[tuple[str, str]]:
    """(BDF, host driver) of every device a slice-mode host keeps on vfio-pci: the GPUs and the fabric VFs."""
    out = [(g.pci_address, "nvidia") for g in desc.gpus]
    for nic in desc.nics:
        if nic.vf_driver == "vfio-pci":
            out += [(f"{nic.pci_address[:-1]}{n + 1}", "mlx5_core") for n in range(nic.numvfs)]
    return out


def write_etc(root: Path, desc: HostDescription) -> None:
    etc = root / "etc"
    for stale in (
        etc / "netplan/60-ipoib.yaml",
        etc / "dnsmasq.d/gpuaas-slice.conf",
        root / H200_IB_DONE,
        root / REBOOT_REQUIRED,
        root / FABRICMANAGER_CFG,
    ):
        if stale.exists():
            stale.unlink()
    shutil.rmtree(root / DRIVERCTL_DIR, ignore_errors=True)
    if desc.driverctl_overrides:
        # What `driverctl set-override <dev> vfio-pci` left behind when the host entered slice mode.
        for bdf, _ in _vfio_devices(desc):
            _write(root / DRIVERCTL_DIR / f"pci-{bdf}", "vfio-pci\n")
    if desc.h200_ib_done:
        _write(root / H200_IB_DONE, "")
    if desc.reboot_required:
        _write(root / REBOOT_REQUIRED, "*** System restart required ***\n")
    _write(root / FABRICMANAGER_CFG, f"FABRIC_MODE={desc.fabricmanager_mode}\n")
    if desc.ipoib_netplan:
        _write(
            etc / "netplan/60-ipoib.yaml",
            f"network:\n  version: 2\n  ethernets:\n    {FABRIC_IF}:\n      addresses: [{desc.fabric_address}]\n",
        )
    if desc.dnsmasq_gpu_subnet:
        # The runbook's range (.10-.250 of the bridge's /24, the bridge as router), on the bridge's subnet.
        bridge = ipaddress.ip_interface(desc.baseline_cidr or desc.ovs_address)
        base = int(bridge.network.network_address)
        _write(
            etc / "dnsmasq.d/gpuaas-slice.conf",
            f"interface={desc.ovs_bridge or 'ovsbr0'}\nbind-interfaces\n"
            f"dhcp-range={ipaddress.ip_address(base + 10)},{ipaddress.ip_address(base + 250)},"
            f"{bridge.network.netmask},12h\n"
            f"dhcp-option=option:router,{bridge.ip}\ndhcp-hostsdir=/etc/gpuaas/dnsmasq-hosts\n",
        )
    _write(etc / "hostname", desc.hostname + "\n")


def _nvidia_smi_q(desc: HostDescription) -> str:
    """`nvidia-smi -q` as the H200 fixture prints it (tests/fixtures/gpu_hosts), cut to what discovery reads."""
    lines = ["", "==============NVSMI LOG==============", "", f"Driver Version : {desc.fabricmanager_version}", ""]
    lines.append(f"Attached GPUs                                          : {len(desc.gpus)}")
    for gpu in desc.gpus:
        domain, rest = gpu.pci_address.split(":", 1)
        lines += [
            f"GPU 0000{domain.upper()}:{rest.upper()}",
            "    Product Name                                       : NVIDIA H200",
            "    Platform Info",
            "        Chassis Serial Number                          : N/A",
            f"        Module Id                                      : {gpu.module_id or 'N/A'}",
            "        GPU Fabric GUID                                : N/A",
            "",
        ]
    return "\n".join(lines) + "\n"


def _write_nvidia_tools(root: Path, data: Path, desc: HostDescription) -> None:
    for tool in ("usr/bin/nvidia-smi", "usr/bin/nv-fabricmanager"):
        if (root / tool).exists():
            (root / tool).unlink()
    if desc.nvidia_smi:
        _write(data / "nvidia-smi-q.txt", _nvidia_smi_q(desc))
        _script(
            root / "usr/bin/nvidia-smi",
            'if [ "$*" = "-q" ]; then cat "$DATA/nvidia-smi-q.txt"; exit 0; fi\n'
            'echo "fixture nvidia-smi: unsupported: $*" >&2; exit 2\n',
        )
    if desc.fabricmanager_version:
        _script(
            root / "usr/bin/nv-fabricmanager",
            'if [ "$1" = "--version" ]; then echo "Fabric Manager version is : '
            + desc.fabricmanager_version
            + '"; exit 0; fi\necho "fixture nv-fabricmanager: unsupported: $*" >&2; exit 2\n',
        )


def write_host_tools(fs: _Sysfs, desc: HostDescription) -> None:
    root = fs.root
    sysroot = fs.sys
    # What `ip`, `iptables` and `systemctl` would say on this host.
    data = root / FIXTURE_DATA
    links = [
        {"ifname": "lo", "addr_info": [{"family": "inet", "local": "127.0.0.1", "prefixlen": 8}]},
        {"ifname": "eno8303", "addr_info": [{"family": "inet", "local": "10.177.36.197", "prefixlen": 24}]},
    ]
    routes = [
        {"dst": "default", "gateway": "10.177.36.1", "dev": "eno8303"},
        {"dst": "10.177.36.0/24", "dev": "eno8303", "prefsrc": "10.177.36.197"},
    ]
    if desc.ovs_bridge:
        addr, plen = desc.ovs_address.split("/")
        links.append(
            {"ifname": desc.ovs_bridge, "addr_info": [{"family": "inet", "local": addr, "prefixlen": int(plen)}]}
        )
        _write(sysroot / "class/net" / desc.ovs_bridge / "address", "0e:5a:11:00:00:01\n")
        _write(sysroot / "class/net" / desc.ovs_bridge / "operstate", "unknown\n")
    if desc.fabric_address:
        addr, plen = desc.fabric_address.split("/")
        links.append({"ifname": FABRIC_IF, "addr_info": [{"family": "inet", "local": addr, "prefixlen": int(plen)}]})
        if desc.fabric_route:
            net = ".".join(addr.split(".")[:3]) + ".0"
            routes.append({"dst": f"{net}/{plen}", "dev": FABRIC_IF, "prefsrc": addr})
    if desc.tmfifo_address:
        addr, plen = desc.tmfifo_address.split("/")
        links.append(
            {"ifname": "tmfifo_net0", "addr_info": [{"family": "inet", "local": addr, "prefixlen": int(plen)}]}
        )
    _write(data / "ip-addr.json", json.dumps(links))
    _write(data / "ip-route.json", json.dumps(routes))
    nat = ["-P POSTROUTING ACCEPT"]
    if desc.nat_rule:
        subnet = ipaddress.ip_interface(desc.baseline_cidr or desc.ovs_address).network
        nat.append(f"-A POSTROUTING -s {subnet} -j MASQUERADE")
    _write(data / "iptables-nat-POSTROUTING.txt", "\n".join(nat) + "\n")
    active = ["openvswitch-switch", "rshim", *desc.slice_services]
    if desc.dnsmasq_active:
        active.append("dnsmasq")
    if desc.nvidia_persistenced_active:
        active.append("nvidia-persistenced")
    if desc.fabricmanager_active:
        active.append("nvidia-fabricmanager")
    if desc.libvirtd_active:
        active.append("libvirtd")
    if desc.network_baseline:
        active.append(desc.network_baseline)
    if desc.node_agent_active:
        active.append("gpuaas-node-agent")
    _write(data / "active-units.txt", "\n".join(active) + "\n")

    sbin = root / "usr/sbin"
    _script(
        sbin / "ip",
        'case "$*" in\n  "-j addr show") cat "$DATA/ip-addr.json";;\n'
        '  "-j route show") cat "$DATA/ip-route.json";;\n'
        '  *) echo "fixture ip: unsupported: $*" >&2; exit 1;;\nesac\n',
    )
    _script(
        sbin / "iptables",
        'if [ "$*" = "-t nat -S POSTROUTING" ]; then cat "$DATA/iptables-nat-POSTROUTING.txt";'
        ' else echo "fixture iptables: unsupported: $*" >&2; exit 2; fi\n',
    )
    _script(
        root / "usr/bin/systemctl",
        'if [ "$1" != "is-active" ]; then echo "fixture systemctl: unsupported: $*" >&2; exit 1; fi\n'
        'unit="${2%.service}"\n'
        'if grep -qx "$unit" "$DATA/active-units.txt"; then echo active; exit 0; fi\n'
        "echo inactive; exit 3\n",
    )
    # dhcp_release makes dnsmasq drop the lease: here the line goes from the lease file the agent reads.
    _script(
        sbin / "dhcp_release",
        'ROOT="$(cd "$(dirname "$0")/../.." && pwd -P)"\nL="$ROOT/var/lib/misc/dnsmasq.leases"\n'
        '[ $# -ge 3 ] || { echo "fixture dhcp_release: usage: IFACE ADDR MAC [CLIENT_ID]" >&2; exit 1; }\n'
        '[ -f "$L" ] || exit 0\n'
        'awk -v mac="$3" \'$2 != mac\' "$L" > "$L.tmp" && mv "$L.tmp" "$L"\n',
    )
    # ovs-vsctl keeps what it was told in OVSDB; here one line per protected port, for tests to read back.
    _script(
        root / "usr/bin/ovs-vsctl",
        '[ "${1#--timeout=}" != "$1" ] && shift\n'
        'if [ "$1 $2" = "set Port" ] && [ "$4" = "protected=true" ]; then\n'
        '  echo "$3" >> "$DATA/ovs-protected.txt"; exit 0\nfi\n'
        'echo "fixture ovs-vsctl: unsupported: $*" >&2; exit 1\n',
    )
    peers = ["192.168.100.2"] if desc.bf3_peer_reachable and desc.tmfifo_address == "192.168.100.1/30" else []
    _write(data / "ping-answers.txt", "".join(f"{p}\n" for p in peers))
    _script(
        root / "usr/bin/ping",
        "for peer; do :; done\n"
        'if grep -qx "$peer" "$DATA/ping-answers.txt"; then echo "1 packets transmitted, 1 received"; exit 0; fi\n'
        'echo "1 packets transmitted, 0 received"; exit 1\n',
    )
    _write(data / "pci-default-drivers.txt", "".join(f"{bdf} {drv}\n" for bdf, drv in _vfio_devices(desc)))
    # driverctl keeps one file per override under /etc/driverctl.d and (re)binds the device at once; here
    # binding is relinking the sysfs `driver` symlink, so the agent's checks read the result for real.
    _script(
        sbin / "driverctl",
        'ROOT="$(cd "$(dirname "$0")/../.." && pwd -P)"\nD="$ROOT/etc/driverctl.d"\n'
        'bind() {\n  real="$(cd "$ROOT/sys/bus/pci/devices/$1" && pwd -P)"\n'
        '  if [ -z "$2" ]; then rm -f "$real/driver"; return; fi\n'
        '  mkdir -p "$ROOT/sys/bus/pci/drivers/$2"\n'
        '  ln -sfn "$(realpath --relative-to="$real" "$ROOT/sys/bus/pci/drivers/$2")" "$real/driver"\n}\n'
        '[ "$1" = "--nosave" ] && { echo "fixture driverctl: --nosave unsupported" >&2; exit 2; }\n'
        'case "$1" in\n'
        '  list-overrides) for f in "$D"/pci-*; do [ -e "$f" ] || continue; echo "${f##*/pci-} $(cat "$f")"; done;;\n'
        "  set-override)\n"
        '    [ -e "$ROOT/sys/bus/pci/devices/$2" ] || { echo "driverctl: device $2 not found" >&2; exit 1; }\n'
        '    mkdir -p "$D" && echo "$3" > "$D/pci-$2" && bind "$2" "$3";;\n'
        "  unset-override)\n"
        '    [ -e "$D/pci-$2" ] || { echo "driverctl: no override for $2" >&2; exit 1; }\n'
        '    rm -f "$D/pci-$2"\n'
        '    bind "$2" "$(grep "^$2 " "$DATA/pci-default-drivers.txt" | cut -d" " -f2)";;\n'
        '  *) echo "fixture driverctl: unsupported: $*" >&2; exit 1;;\nesac\n',
    )
    _write_nvidia_tools(root, data, desc)
    # Signature probes are the real tools: they read the disk stand-ins like they read a device.
    for tool in ("wipefs", "blkid"):
        real = shutil.which(tool)
        if real:
            link = sbin / tool
            if link.is_symlink() or link.exists():
                link.unlink()
            os.symlink(real, link)
    return root
