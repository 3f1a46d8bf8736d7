"""The slice host parity check of the bootstrap runbook, one result per condition.

Checks verify behaviour (an address on the bridge, a NAT rule, a route), not package presence: the lab hosts
that looked healthy had the packages and still sent tenant traffic to the firewall unNATed.
"""

from __future__ import annotations

import ipaddress
import json
import re
import shlex
from collections.abc import Awaitable, Callable

from gpuaas_common.contract import messages as m
from gpuaas_common.contract import utcnow
from gpuaas_common.logging import get_logger

from .discovery import interface_addresses
from .host import Host

log = get_logger(__name__)

NORMALISED_BASELINE = "gpuaas-slice-network-baseline"
HISTORICAL_BASELINE = "gpuaas-slice-host-net-baseline"
VFIO_MODULES = ("vfio", "vfio_pci", "vfio_iommu_type1")
FABRIC_IFACE = re.compile(r"^ib")


def _ok(check: str, detail: str) -> m.ParityCheck:
    return m.ParityCheck(check=check, status="PASS", detail=detail)


def _fail(check: str, detail: str, remediation: str) -> m.ParityCheck:
    return m.ParityCheck(check=check, status="FAIL", detail=detail, remediation=remediation)


class ParityChecker:
    def __init__(
        self, host: Host, *, bridge: str = "ovsbr0", bridge_cidr: str = "10.100.0.1/24", agent_running: bool = False
    ) -> None:
        self.host = host
        self.bridge = bridge
        self.bridge_if = ipaddress.ip_interface(bridge_cidr)
        self.agent_running = agent_running
        self._addresses: dict[str, list[str]] | None = None

    async def addresses(self) -> dict[str, list[str]]:
        if self._addresses is None:
            self._addresses = await interface_addresses(self.host)
        return self._addresses

    async def _unit_active(self, unit: str) -> bool:
        res = await self.host.run.run("systemctl", "is-active", unit)
        return res.ok and res.stdout.strip() == "active"

    # --- one method per runbook condition -------------------------------------------------------------

    async def kvm(self) -> m.ParityCheck:
        if self.host.fs.exists("/dev/kvm"):
            return _ok("kvm", "/dev/kvm present")
        return _fail("kvm", "/dev/kvm missing", "enable VT-x/VMX in firmware (BIOS.ProcSettings.ProcVirtualization)")

    async def iommu_groups(self) -> m.ParityCheck:
        groups = self.host.fs.listdir("/sys/kernel/iommu_groups")
        if groups:
            return _ok("iommu_groups", f"{len(groups)} groups")
        return _fail("iommu_groups", "no IOMMU groups", "enable VT-d in firmware and boot with intel_iommu=on iommu=pt")

    async def vfio_modules(self) -> m.ParityCheck:
        # /sys/module lists built-in modules too, which lsmod does not.
        missing = [mod for mod in VFIO_MODULES if not self.host.fs.exists(f"/sys/module/{mod}")]
        if not missing:
            return _ok("vfio_modules", ",".join(VFIO_MODULES))
        return _fail(
            "vfio_modules",
            "not loaded: " + ",".join(missing),
            "load vfio modules via /etc/modules-load.d/gpuaas-vfio.conf",
        )

    async def libvirtd(self) -> m.ParityCheck:
        for unit in ("libvirtd", "virtqemud"):
            if await self._unit_active(unit):
                return _ok("libvirtd", f"{unit} active")
        return _fail("libvirtd", "neither libvirtd nor virtqemud is active", "systemctl enable --now libvirtd")

    async def ovs_bridge(self) -> m.ParityCheck:
        have = (await self.addresses()).get(self.bridge)
        want = str(self.bridge_if)
        if have is None:
            return _fail("ovs_bridge", f"{self.bridge} missing", "run the slice network baseline (creates the bridge)")
        if want not in have:
            return _fail(
                "ovs_bridge",
                f"{self.bridge} has {','.join(have) or 'no address'}, expected {want}",
                f"ip addr add {want} dev {self.bridge}",
            )
        return _ok("ovs_bridge", f"{self.bridge} {want}")

    async def dnsmasq_gpu_subnet(self) -> m.ParityCheck:
        net = self.bridge_if.network
        fs = self.host.fs
        for name in fs.listdir("/etc/dnsmasq.d"):
            text = fs.read(f"/etc/dnsmasq.d/{name}") or ""
            lines = [line.strip() for line in text.splitlines()]
            on_bridge = f"interface={self.bridge}" in lines
            ranges = [line.split("=", 1)[1].split(",")[0] for line in lines if line.startswith("dhcp-range=")]
            in_net = any(_in_network(r, net) for r in ranges)
            if on_bridge and in_net:
                return _ok("dnsmasq_gpu_subnet", f"/etc/dnsmasq.d/{name} serves {net} on {self.bridge}")
        return _fail(
            "dnsmasq_gpu_subnet",
            f"no dnsmasq config serves {net} on {self.bridge}",
            "render /etc/dnsmasq.d/gpuaas-slice.conf from the network baseline",
        )

    async def nat_rule(self) -> m.ParityCheck:
        net = self.bridge_if.network
        res = await self.host.run.run("iptables", "-t", "nat", "-S", "POSTROUTING")
        if not res.ok:
            return _fail(
                "nat_rule",
                f"iptables exited with {res.rc}: {res.stderr[:200]}",
                "install iptables and run the slice network baseline",
            )
        for line in res.stdout.splitlines():
            words = shlex.split(line)
            if words[:2] == ["-A", "POSTROUTING"] and "MASQUERADE" in words and "-s" in words:
                if words[words.index("-s") + 1] == str(net):
                    return _ok("nat_rule", f"-s {net} -j MASQUERADE")
        return _fail(
            "nat_rule",
            f"no MASQUERADE rule for {net}",
            f"iptables -t nat -A POSTROUTING -s {net} -j MASQUERADE (network baseline service)",
        )

    async def ip_forwarding(self) -> m.ParityCheck:
        value = self.host.fs.read("/proc/sys/net/ipv4/ip_forward")
        if value == "1":
            return _ok("ip_forwarding", "net.ipv4.ip_forward=1")
        return _fail("ip_forwarding", f"net.ipv4.ip_forward={value}", "sysctl -w net.ipv4.ip_forward=1 and persist it")

    async def ipoib_netplan(self) -> m.ParityCheck:
        if self.host.fs.exists("/etc/netplan/60-ipoib.yaml"):
            return _ok("ipoib_netplan", "/etc/netplan/60-ipoib.yaml present")
        return _fail(
            "ipoib_netplan",
            "/etc/netplan/60-ipoib.yaml missing",
            "render /etc/netplan/60-ipoib.yaml from site/profile bootstrap",
        )

    async def fabric_route(self) -> m.ParityCheck:
        fabric = {
            ifname: cidrs for ifname, cidrs in (await self.addresses()).items() if FABRIC_IFACE.match(ifname) and cidrs
        }
        if not fabric:
            return _fail(
                "fabric_route",
                "no ibp* interface owns a fabric address",
                "apply the IPoIB netplan and bring the fabric interface up",
            )
        res = await self.host.run.run("ip", "-j", "route", "show")
        try:
            routes = json.loads(res.stdout or "[]") if res.ok else []
        except ValueError:
            routes = []
        for ifname, cidrs in sorted(fabric.items()):
            nets = {str(ipaddress.ip_interface(c).network) for c in cidrs}
            if any(r.get("dev") == ifname and r.get("dst") in nets for r in routes):
                return _ok("fabric_route", f"{ifname} {','.join(cidrs)} routed")
        return _fail(
            "fabric_route",
            f"no route for the fabric subnet via {','.join(sorted(fabric))}",
            "add the fabric route for the configured IPoIB subnet",
        )

    async def network_baseline_service(self) -> m.ParityCheck:
        if await self._unit_active(NORMALISED_BASELINE):
            return _ok("network_baseline_service", f"{NORMALISED_BASELINE} active")
        if await self._unit_active(HISTORICAL_BASELINE):
            return m.ParityCheck(
                check="network_baseline_service",
                status="WARN",
                detail=f"only the historical {HISTORICAL_BASELINE} is active",
                remediation=f"migrate to {NORMALISED_BASELINE}",
            )
        return _fail(
            "network_baseline_service",
            f"{NORMALISED_BASELINE} not active",
            f"install and enable {NORMALISED_BASELINE}.service",
        )

    async def node_agent(self) -> m.ParityCheck:
        if self.agent_running:
            return _ok("node_agent", "reporting")
        if await self._unit_active("gpuaas-node-agent"):
            return _ok("node_agent", "gpuaas-node-agent active")
        return _fail("node_agent", "gpuaas-node-agent not active", "systemctl enable --now gpuaas-node-agent")

    def checks(self) -> list[Callable[[], Awaitable[m.ParityCheck]]]:
        return [
            self.kvm,
            self.iommu_groups,
            self.vfio_modules,
            self.libvirtd,
            self.ovs_bridge,
            self.dnsmasq_gpu_subnet,
            self.nat_rule,
            self.ip_forwarding,
            self.ipoib_netplan,
            self.fabric_route,
            self.network_baseline_service,
            self.node_agent,
        ]

    async def run(self, node_id: str, *, task_id: str | None = None) -> m.NodeParityReported:
        results = []
        for check in self.checks():
            try:
                results.append(await check())
            except Exception as exc:  # a check that cannot run is a failure, never a pass
                name = check.__name__
                results.append(_fail(name, f"check raised {type(exc).__name__}: {exc}", "inspect the agent log"))
        failures = sum(r.status == "FAIL" for r in results)
        warnings = sum(r.status == "WARN" for r in results)
        log.info(
            "parity_checked",
            node_id=node_id,
            task_id=task_id,
            failures=failures,
            warnings=warnings,
            failed=[r.check for r in results if r.status == "FAIL"],
        )
        return m.NodeParityReported(
            node_id=node_id, task_id=task_id, checked_at=utcnow(), checks=results, failures=failures, warnings=warnings
        )


def _in_network(address: str, net: ipaddress.IPv4Network | ipaddress.IPv6Network) -> bool:
    try:
        return ipaddress.ip_address(address.strip()) in net
    except ValueError:
        return False


def _quote(value: str) -> str:
    return value.replace("\\", "\\\\").replace(" ", "\\ ")


def format_lines(report: m.NodeParityReported) -> list[str]:
    """The runbook's machine-readable lines (blanks escaped with a backslash, as the shell checker does)."""
    lines = []
    for c in report.checks:
        line = f"GPUAAS_SLICE_PARITY status={c.status} check={c.check} detail={_quote(c.detail)}"
        if c.remediation:
            line += f" remediation={_quote(c.remediation)}"
        lines.append(line)
    lines.append(
        f"GPUAAS_SLICE_PARITY summary checks={len(report.checks)} failures={report.failures} warnings={report.warnings}"
    )
    return lines
