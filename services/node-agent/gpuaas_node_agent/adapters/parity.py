"""The slice host parity check of the bootstrap runbook, one result per condition.

Checks verify behaviour (an address on the bridge, a NAT rule, a route), not package presence: the lab hosts
that looked healthy had the packages and still sent tenant traffic to the firewall unNATed.
"""

from __future__ import annotations

import ipaddress
import json
import re
import shlex
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any

from gpuaas_common.contract import messages as m
from gpuaas_common.contract import utcnow
from gpuaas_common.logging import get_logger

from ..domain.device_binding import VFIO_DRIVER, binding_problems, derive_binding
from ..domain.gpu_modules import fabric_mode
from . import driverctl
from .discovery import interface_addresses
from .host import Host

log = get_logger(__name__)

NORMALISED_BASELINE = "gpuaas-slice-network-baseline"
HISTORICAL_BASELINE = "gpuaas-slice-host-net-baseline"
VFIO_MODULES = ("vfio", "vfio_pci", "vfio_iommu_type1")
FABRIC_IFACE = re.compile(r"^ib")
# The slice services of the host-image runbook's slice baseline, besides the network baseline (its own check,
# with the historical name as a warning): (check, unit).
SLICE_SERVICES = (
    ("fabric_vfs_service", "gpuaas-slice-fabric-vfs"),
    ("vfio_devices_service", "gpuaas-slice-vfio-devices"),
    ("ovs_bridge_service", "gpuaas-slice-ovs-bridge"),
)
H200_IB_DONE = "/var/lib/gpuaas/site-bootstrap/h200-ib.done"
REBOOT_REQUIRED = "/var/run/reboot-required"
FABRICMANAGER_CFG = "/usr/share/nvidia/nvswitch/fabricmanager.cfg"
TMFIFO = "tmfifo_net0"
TMFIFO_CIDR = "192.168.100.1/30"
# The BlueField-3's end of the RShim link (runbook: "BF3 peer 192.168.100.2 responds to ping").
BF3_PEER = "192.168.100.2"
# Optional management evidence (runbook: "optional tmfifo_net0 management evidence"): a WARN, unless a site makes
# its BlueField management link required (`require_bf3_management`), when it is a FAIL like any other check.
BF3_MANAGEMENT_CHECKS = frozenset({"tmfifo_net0", "bf3_peer"})
# The checks with nothing to look at on an emulated-slot host: IOMMU, VFIO and GPU bindings, the fabric and
# IPoIB, the host GPU services, the BlueField link, and the systemd units of the slice baseline (the lab makes
# its bridge, dnsmasq and libvirtd itself; the bridge address, NAT, forwarding and libvirt are still checked).
NOT_APPLICABLE_EMULATED = frozenset(
    {
        "iommu_groups",
        "vfio_modules",
        "dnsmasq_gpu_subnet",
        "ipoib_netplan",
        "fabric_route",
        "network_baseline_service",
        "vfio_binding",
        "nvidia_persistenced",
        "nvidia_fabricmanager",
        "fabric_vfs_service",
        "vfio_devices_service",
        "ovs_bridge_service",
        "dnsmasq_service",
        "host_baseline",
        "tmfifo_net0",
        "bf3_peer",
    }
)


def _ok(check: str, detail: str) -> m.ParityCheck:
    return m.ParityCheck(check=check, status="PASS", detail=detail)


def _fail(check: str, detail: str, remediation: str) -> m.ParityCheck:
    return m.ParityCheck(check=check, status="FAIL", detail=detail, remediation=remediation)


class ParityChecker:
    def __init__(
        self,
        host: Host,
        *,
        bridge: str = "ovsbr0",
        bridge_cidr: str = "10.100.0.1/24",
        agent_running: bool = False,
        topology: m.NodeTopologyReported | None = None,
        emulated: bool = False,
        libvirt_alive: Callable[[], Awaitable[bool]] | None = None,
        require_bf3_management: bool = False,
        approved_slots: Iterable[Mapping[str, Any] | m.SlotBinding] = (),
        released: bool = False,
    ) -> None:
        self.host = host
        # The host's last binding was a release (slice.vfio_apply unbind, on leaving slice mode): no device on
        # vfio-pci is then what the scheduler asked for, not a host that never entered slice mode.
        self.released = released
        # The approved slots the agent knows of (as its tasks carried them): their GPUs and fabric VFs must all
        # be on vfio-pci, so a host that bound only some of them fails `vfio_binding`.
        self.approved_slots = list(approved_slots)
        self.require_bf3_management = require_bf3_management
        # The emulated profile (a lab host whose slots carry no GPU and no fabric VF): every check of hardware
        # or of the host GPU services has nothing to look at and says so as a WARN; the rest run unchanged.
        self.emulated = emulated
        self.libvirt_alive = libvirt_alive
        # The agent's own topology report when it runs the checks; None when only local checks run (the CLI).
        self.topology = topology
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
        if self.emulated and self.libvirt_alive is not None:
            # The lab's libvirtd is the lab's own process, no unit: its connection answering is the evidence.
            if await self.libvirt_alive():
                return _ok("libvirtd", "the agent's libvirt connection answers")
            return _fail("libvirtd", "the agent's libvirt connection is refused", "start the host's libvirtd")
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

    # --- device binding (slice mode keeps GPUs and fabric VFs on vfio-pci, host GPU services quiesced) --------

    async def vfio_binding(self) -> m.ParityCheck:
        """Every device the approved slots pass through (emulated slots pass none), and every device with a
        persistent vfio-pci override, has its override and is bound to vfio-pci right now; a partial binding
        fails naming each device left out."""
        overrides = await driverctl.list_overrides(self.host)
        wanted = derive_binding(self.approved_slots).devices
        if not wanted and not any(drv == VFIO_DRIVER for drv in overrides.values()):
            if self.released:
                return m.ParityCheck(
                    check="vfio_binding",
                    status="WARN",
                    detail="no device on vfio-pci: the host left slice mode and released its binding; the scheduler "
                    "asks for the approved binding again when it enters slice mode",
                )
            return _fail(
                "vfio_binding",
                "no persistent vfio-pci driverctl override: the host has not entered slice mode",
                "enter slice mode (gpuaas-node-agent slice-mode enter): persistent driverctl overrides generated "
                "from the approved topology",
            )
        devices = set(wanted) | {d for d, drv in overrides.items() if drv == VFIO_DRIVER}
        present = [d for d in devices if self.host.fs.exists(f"/sys/bus/pci/devices/{d}")]
        bound = {d: driverctl.bound_driver(self.host, d) for d in present}
        problems = binding_problems(wanted, overrides, bound, present)
        if problems:
            return _fail(
                "vfio_binding",
                f"{len(problems)} of {len(devices)} approved devices not on vfio-pci: "
                + "; ".join(f"{dev} {', '.join(why)}" for dev, why in problems.items()),
                "bind GPU and fabric devices to vfio-pci with persistent driverctl overrides generated from the "
                "approved topology, not hard-coded PCI lists",
            )
        return _ok("vfio_binding", f"{len(devices)} approved devices on vfio-pci")

    async def nvidia_persistenced(self) -> m.ParityCheck:
        if await self._unit_active("nvidia-persistenced"):
            return _fail(
                "nvidia_persistenced",
                "nvidia-persistenced active (holds /dev/nvidia*, blocks VFIO detach)",
                "systemctl disable --now nvidia-persistenced.service on slice-mode hosts",
            )
        return _ok("nvidia_persistenced", "inactive")

    async def nvidia_fabricmanager(self) -> m.ParityCheck:
        """Shared-NVSwitch mode (issue 29): Fabric Manager runs on the host in FABRIC_MODE=1, keeps the NVSwitches
        and activates each multi-GPU VM's NVLink partition, while the GPUs stay on vfio-pci (`vfio_binding`).
        Bare-metal mode holds the NVSwitch and NVLink devices and blocks passthrough; vGPU mode is another
        model. A host without Fabric Manager installed has no NVSwitch partitions to activate: nothing to check."""
        cfg = self.host.fs.read_raw(FABRICMANAGER_CFG)
        installed = cfg is not None or self.host.run.which("nv-fabricmanager") is not None
        active = await self._unit_active("nvidia-fabricmanager")
        if not installed and not active:
            return _ok("nvidia_fabricmanager", "not installed: no NVSwitch partitions on this host")
        mode = fabric_mode(cfg)
        to_shared = (
            "set FABRIC_MODE=1 (shared NVSwitch) in fabricmanager.cfg and systemctl restart "
            "nvidia-fabricmanager.service on slice-mode hosts"
        )
        if active and mode == "baremetal":
            return _fail(
                "nvidia_fabricmanager",
                "nvidia-fabricmanager active in bare-metal mode (FABRIC_MODE=0 holds NVSwitch and NVLink devices)",
                to_shared,
            )
        if mode != "shared_nvswitch":
            return _fail("nvidia_fabricmanager", f"Fabric Manager in {mode} mode, not shared NVSwitch", to_shared)
        if not active:
            return _fail(
                "nvidia_fabricmanager",
                "nvidia-fabricmanager inactive: no NVLink partition can be activated for a multi-GPU slice",
                "systemctl enable --now nvidia-fabricmanager.service (FABRIC_MODE=1)",
            )
        return _ok("nvidia_fabricmanager", "active in shared NVSwitch mode (FABRIC_MODE=1)")

    # --- the rest of the slice baseline -------------------------------------------------------------------

    async def _service(self, check: str, unit: str) -> m.ParityCheck:
        if await self._unit_active(unit):
            return _ok(check, f"{unit} active")
        return _fail(check, f"{unit} not active", f"systemctl enable --now {unit}.service (slice host bootstrap)")

    async def fabric_vfs_service(self) -> m.ParityCheck:
        return await self._service(*SLICE_SERVICES[0])

    async def vfio_devices_service(self) -> m.ParityCheck:
        return await self._service(*SLICE_SERVICES[1])

    async def ovs_bridge_service(self) -> m.ParityCheck:
        return await self._service(*SLICE_SERVICES[2])

    async def dnsmasq_service(self) -> m.ParityCheck:
        if await self._unit_active("dnsmasq"):
            return _ok("dnsmasq_service", "dnsmasq active")
        return _fail(
            "dnsmasq_service",
            "dnsmasq not active",
            "restart dnsmasq.service (the network baseline service restarts it from ExecStartPost=)",
        )

    async def host_baseline(self) -> m.ParityCheck:
        if self.host.fs.exists(H200_IB_DONE):
            return _ok("host_baseline", f"{H200_IB_DONE} present")
        return _fail(
            "host_baseline",
            f"{H200_IB_DONE} missing: host-baseline incomplete",
            "run /usr/local/share/gpuaas/site-bootstrap/h200-ib/bootstrap.sh (H200/IB, NVIDIA, OFED and fabric "
            "baseline) before the slice bootstrap",
        )

    def _bf3_problem(self, check: str, detail: str, remediation: str) -> m.ParityCheck:
        if self.require_bf3_management:
            return _fail(check, detail, remediation)
        return m.ParityCheck(
            check=check,
            status="WARN",
            detail=f"{detail} (optional management evidence on this site)",
            remediation=remediation,
        )

    async def tmfifo_net0(self) -> m.ParityCheck:
        have = (await self.addresses()).get(TMFIFO)
        if have is None:
            return self._bf3_problem(
                "tmfifo_net0",
                f"{TMFIFO} missing",
                "check rshim is active; the network baseline service repairs the tmfifo_net0 address after reboot",
            )
        if TMFIFO_CIDR not in have:
            return self._bf3_problem(
                "tmfifo_net0",
                f"{TMFIFO} has {','.join(have) or 'no address'}, expected {TMFIFO_CIDR}",
                f"ip addr add {TMFIFO_CIDR} dev {TMFIFO} (network baseline service)",
            )
        return _ok("tmfifo_net0", f"{TMFIFO} {TMFIFO_CIDR}")

    async def bf3_peer(self) -> m.ParityCheck:
        # Probed, not assumed from the address: the runbook's remediation was verified by the peer answering.
        res = await self.host.run.run("ping", "-c", "1", "-W", "2", BF3_PEER)
        if res.ok:
            return _ok("bf3_peer", f"BF3 peer {BF3_PEER} answers ping")
        return self._bf3_problem(
            "bf3_peer",
            f"BF3 peer {BF3_PEER} does not answer ping (exit {res.rc})",
            "check rshim and the tmfifo_net0 address (network baseline service); the BF3 must be up",
        )

    async def reboot_required(self) -> m.ParityCheck:
        if self.host.fs.exists(REBOOT_REQUIRED):
            return _fail(
                "reboot_required",
                f"{REBOOT_REQUIRED} present (kernel args or initramfs changed)",
                "reboot the host and re-run the slice validation (GPUAAS_SLICE_REBOOT_IF_REQUIRED=1 lets the "
                "bootstrap reboot it)",
            )
        return _ok("reboot_required", "no reboot pending")

    async def api_topology(self) -> m.ParityCheck:
        if self.topology is None:
            return m.ParityCheck(
                check="api_topology",
                status="WARN",
                detail="only local checks ran: node-agent topology evidence not proven",
                remediation="acceptable for first-pass host diagnosis, not for scheduler approval: check the "
                "topology the agent reported (slice.topology_discover)",
            )
        if self.topology.blockers:
            return m.ParityCheck(
                check="api_topology",
                status="WARN",
                detail=f"completed with {len(self.topology.blockers)} blockers: " + "; ".join(self.topology.blockers),
                remediation="resolve the topology blockers before approving the affected slots",
            )
        return _ok("api_topology", f"completed with no blockers, {len(self.topology.candidate_slots)} candidates")

    def checks(self) -> list[Callable[[], Awaitable[m.ParityCheck]]]:
        every = self._all_checks()
        if not self.emulated:
            return every
        return [self._not_applicable(c.__name__) if c.__name__ in NOT_APPLICABLE_EMULATED else c for c in every]

    @staticmethod
    def _not_applicable(check: str) -> Callable[[], Awaitable[m.ParityCheck]]:
        async def warn() -> m.ParityCheck:
            return m.ParityCheck(
                check=check,
                status="WARN",
                detail="not applicable on an emulated-slot host: no GPU, fabric or host GPU service to check",
                remediation="a GPU host runs this check; emulated slots are for labs only",
            )

        warn.__name__ = check
        return warn

    def _all_checks(self) -> list[Callable[[], Awaitable[m.ParityCheck]]]:
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
            self.vfio_binding,
            self.nvidia_persistenced,
            self.nvidia_fabricmanager,
            self.fabric_vfs_service,
            self.vfio_devices_service,
            self.ovs_bridge_service,
            self.dnsmasq_service,
            self.host_baseline,
            self.tmfifo_net0,
            self.bf3_peer,
            self.reboot_required,
            self.api_topology,
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
            node_id=node_id,
            task_id=task_id,
            checked_at=utcnow(),
            checks=results,
            failures=failures,
            warnings=warnings,
            profile="emulated" if self.emulated else "slice_host",
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
