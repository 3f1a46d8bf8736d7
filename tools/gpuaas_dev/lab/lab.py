"""The lab: one real slice host on this machine, inside a network namespace the lab makes itself.

Inside the namespace: a Linux bridge with the runbook's GPU-network address (rendered, never routed out),
dnsmasq serving DHCP reservations from the agent's hostsdir, a libvirt daemon of the lab's own (system mode,
its sockets under the run dir) whose guests' taps land on that bridge, and forwarders that carry the root
namespace's loopback services (NATS, the registry) over unix sockets to the same loopback ports inside, so
the production agent runs in the namespace with the very URLs it would use on the box. Each slot's raw disk
is a loop device over a sparse file, named by a /dev/disk/by-id link as an NVMe namespace would be.

Everything the lab made is written to `lab.json` as it is made, so `down` (in another process, after a
crash) removes exactly that: domains with their NVRAM, daemons by PID, loop devices, links, the namespace.
"""

from __future__ import annotations

import grp
import ipaddress
import json
import os
import shutil
import signal
import stat
import subprocess
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

from gpuaas_common.logging import get_logger

from . import preflight

log = get_logger(__name__)

BRIDGE = "gpubr0"
# The runbook's slice network (ovsbr0 10.100.0.1/24); here it exists only inside the namespace.
BRIDGE_CIDR = "10.100.0.1/24"
SLOT_IP_BASE = 10  # slot N gets 10.100.0.(10 + N)
SLOT_DISK_GIB = 4
DAEMON_START_S = 30.0
CAPS_PROBE_S = 300.0
HOST_DIRS = "/var/lib/gpuaas-lab"


@dataclass
class LabSlot:
    index: int
    disk_file: str
    loop_device: str
    by_id: str
    mac: str
    private_ip: str
    size_bytes: int


@dataclass
class LabState:
    netns: str
    root: str
    bridge: str = BRIDGE
    bridge_cidr: str = BRIDGE_CIDR
    libvirt_sock_dir: str = ""
    hostsdir: str = ""
    lease_file: str = ""
    # The agent's own directories (image cache, state, seeds) at their runbook paths under this prefix. Not
    # under the run dir: QEMU runs as libvirt's unprivileged user and must reach the seed, and a run dir may
    # sit under a private (0700) parent such as a test's temporary directory.
    host_dir: str = ""
    pids: dict[str, int] = field(default_factory=dict)
    slots: list[LabSlot] = field(default_factory=list)
    forwards: dict[str, int] = field(default_factory=dict)  # name -> loopback port forwarded into the namespace

    @property
    def libvirt_uri(self) -> str:
        return f"qemu:///system?socket={self.libvirt_sock_dir}/libvirt-sock"

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> LabState:
        slots = [LabSlot(**s) for s in data.pop("slots", [])]
        return cls(**data, slots=slots)


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    res = subprocess.run(argv, capture_output=True, text=True)
    if check and res.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({res.returncode}): {res.stderr.strip()[:500]}")
    return res


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        # A zombie child of ours is gone for every purpose here.
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _stop_pid(pid: int, timeout_s: float = 10.0) -> None:
    if not _alive(pid):
        return
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass
        if not _alive(pid):
            return
        time.sleep(0.05)
    try:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    except (ProcessLookupError, ChildProcessError):
        pass


def _wait_for(predicate, timeout_s: float, what: str, pid: int | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        if pid is not None and not _alive(pid):
            raise RuntimeError(f"{what} exited before it was ready")
        time.sleep(0.05)
    raise TimeoutError(f"{what} not ready after {timeout_s:.0f}s")


def slot_mac(netns: str, index: int) -> str:
    # Locally administered, unicast; stable per lab and slot so a reservation written by the agent matches.
    h = uuid.uuid5(uuid.NAMESPACE_DNS, f"{netns}/{index}").bytes
    return "52:54:00:" + ":".join(f"{b:02x}" for b in h[:3])


class Lab:
    """Make and remove the lab. `up` records each piece in `<root>/lab.json` the moment it exists."""

    def __init__(self, root: Path, *, slots: int = 1, slot_disk_gib: int = SLOT_DISK_GIB) -> None:
        self.root = Path(root).resolve()
        self.state_file = self.root / "lab.json"
        self.slots = slots
        self.slot_disk_gib = slot_disk_gib
        self.state: LabState | None = None

    # --- state -------------------------------------------------------------------------------------

    def _save(self) -> None:
        assert self.state is not None
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.state.to_json(), indent=2))
        tmp.replace(self.state_file)

    @classmethod
    def load(cls, root: Path) -> Lab | None:
        lab = cls(root)
        if not lab.state_file.exists():
            return None
        lab.state = LabState.from_json(json.loads(lab.state_file.read_text()))
        lab.slots = len(lab.state.slots)
        return lab

    def ns(self, *argv: str) -> list[str]:
        assert self.state is not None
        return ["ip", "netns", "exec", self.state.netns, *argv]

    def spawn(self, name: str, argv: list[str], *, env: dict[str, str] | None = None) -> int:
        assert self.state is not None
        logs = self.root / "logs"
        logs.mkdir(exist_ok=True)
        with (logs / f"{name}.log").open("ab") as out:
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env={**os.environ, **(env or {})},
            )
        self.state.pids[name] = proc.pid
        self._save()
        return proc.pid

    def stop(self, name: str) -> None:
        """Stop one process the lab started (by the pid it recorded)."""
        assert self.state is not None
        pid = self.state.pids.pop(name, None)
        if pid is not None:
            _stop_pid(pid, timeout_s=30.0)
            self._save()

    # --- up ----------------------------------------------------------------------------------------

    def up(self, forwards: dict[str, int] | None = None) -> LabState:
        """Make the lab; on any failure everything made so far is removed again and the error raised."""
        preflight.check()
        self.root.mkdir(parents=True, exist_ok=True)
        netns = f"gpuaas-lab-{uuid.uuid4().hex[:8]}"
        self.state = LabState(netns=netns, root=str(self.root), host_dir=f"{HOST_DIRS}/{netns}")
        self._save()
        try:
            self._make_namespace()
            self._start_dhcp()
            self._start_libvirt()
            for name, port in (forwards or {}).items():
                self.forward(name, port)
            for index in range(self.slots):
                self._make_slot(index)
        except BaseException:
            log.error("lab_up_failed", netns=netns)
            self.down()
            raise
        log.info("lab_up", netns=netns, libvirt_uri=self.state.libvirt_uri, slots=len(self.state.slots))
        return self.state

    def _make_namespace(self) -> None:
        assert self.state is not None
        Path(self.state.host_dir).mkdir(mode=0o755, parents=True)
        os.chmod(HOST_DIRS, 0o755)
        _run("ip", "netns", "add", self.state.netns)
        _run(*self.ns("ip", "link", "set", "lo", "up"))
        _run(*self.ns("ip", "link", "add", BRIDGE, "type", "bridge"))
        _run(*self.ns("ip", "addr", "add", BRIDGE_CIDR, "dev", BRIDGE))
        _run(*self.ns("ip", "link", "set", BRIDGE, "up"))
        # The runbook's network baseline, inside the namespace only: forwarding and NAT for the slice subnet. The
        # namespace has no uplink, so nothing is forwarded anywhere; the agent's parity checks them as on a host.
        _run(*self.ns("sysctl", "-q", "-w", "net.ipv4.ip_forward=1"))
        net = ipaddress.ip_interface(BRIDGE_CIDR).network
        _run(*self.ns("iptables", "-t", "nat", "-A", "POSTROUTING", "-s", str(net), "-j", "MASQUERADE"))

    def _start_dhcp(self) -> None:
        """dnsmasq on the bridge, reservations only (`static`): a guest the agent reserved nothing for gets no
        address, as on a host. The agent writes the reservations and reads the leases, as in production."""
        assert self.state is not None
        # At the runbook's paths under the host prefix: dnsmasq drops root for an unprivileged user and then
        # reads the reservations through that user's eyes, so they must not sit under a private (0700) run dir.
        hostsdir = Path(self.state.host_dir) / "etc/gpuaas/dnsmasq-hosts"
        hostsdir.mkdir(mode=0o755, parents=True, exist_ok=True)
        lease_file = Path(self.state.host_dir) / "var/lib/misc/dnsmasq.leases"
        lease_file.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
        lease_file.touch()
        self.state.hostsdir, self.state.lease_file = str(hostsdir), str(lease_file)
        gateway = BRIDGE_CIDR.split("/")[0]
        network = gateway.rsplit(".", 1)[0] + ".0"
        pid = self.spawn(
            "dnsmasq",
            self.ns(
                "dnsmasq",
                "--keep-in-foreground",
                "--conf-file=/dev/null",
                "--no-resolv",
                "--no-hosts",
                "--port=0",
                f"--interface={BRIDGE}",
                "--bind-interfaces",
                f"--dhcp-range={network},static,255.255.255.0,12h",
                f"--dhcp-hostsdir={hostsdir}",
                f"--dhcp-leasefile={lease_file}",
                "--dhcp-authoritative",
                "--log-dhcp",
                "--log-facility=-",  # to the lab's log file (stderr), not a syslog this machine may not run
                f"--pid-file={self.root / 'dnsmasq.pid'}",
            ),
        )
        _wait_for(lambda: (self.root / "dnsmasq.pid").exists(), DAEMON_START_S, "dnsmasq", pid)

    @staticmethod
    def _kvm_device_as_udev_leaves_it() -> None:
        """/dev/kvm as Debian's udev rule leaves it (group kvm, 0660). Without udev it stays root-only; libvirt
        then finds KVM unusable for QEMU's user while its probe, run as root, found it usable, judges its
        capability cache outdated at every look-up and probes QEMU again: 48 s on every define here."""
        kvm = Path("/dev/kvm")
        if not kvm.exists():
            return
        try:
            gid = grp.getgrnam("kvm").gr_gid
        except KeyError:
            return
        st = kvm.stat()
        if st.st_gid != gid or stat.S_IMODE(st.st_mode) != 0o660:
            os.chown(kvm, -1, gid)
            os.chmod(kvm, 0o660)
            log.info("kvm_device_permissions_set", path=str(kvm), group="kvm", mode="0660", reason="no udev here")

    def _start_libvirt(self) -> None:
        assert self.state is not None
        self._kvm_device_as_udev_leaves_it()
        sock_dir = self.root / "libvirt"
        sock_dir.mkdir(mode=0o700, exist_ok=True)
        conf = self.root / "libvirtd.conf"
        conf.write_text(f'unix_sock_dir = "{sock_dir}"\nunix_sock_rw_perms = "0700"\nauth_unix_rw = "none"\n')
        self.state.libvirt_sock_dir = str(sock_dir)
        # libvirtd finds virtlogd at its fixed system socket; without it every domain start fails.
        if not Path("/run/libvirt/virtlogd-sock").exists():
            pid = self.spawn("virtlogd", self.ns("virtlogd", "--pid-file", str(self.root / "virtlogd.pid")))
            _wait_for(lambda: Path("/run/libvirt/virtlogd-sock").exists(), DAEMON_START_S, "virtlogd", pid)
        pid = self.spawn(
            "libvirtd", self.ns("libvirtd", "--config", str(conf), "--pid-file", str(self.root / "libvirtd.pid"))
        )
        _wait_for(lambda: (sock_dir / "libvirt-sock").exists(), DAEMON_START_S, "libvirtd", pid)
        # A new libvirtd probes every QEMU binary before it defines anything (tens of seconds under load here):
        # waited for now, so the cost shows as the lab's start and not inside a slice's define phase.
        probe = ("virsh", "-c", self.state.libvirt_uri, "domcapabilities", "--virttype", "qemu", "--machine", "q35")
        _wait_for(lambda: _run(*probe, check=False).returncode == 0, CAPS_PROBE_S, "libvirtd's QEMU probe", pid)

    def forward(self, name: str, port: int, bind: str = "127.0.0.1") -> None:
        """`bind`:`port` inside the namespace (loopback, or the bridge's address for the guests) reaches
        127.0.0.1:`port` of the root namespace, through a unix socket: no route, no veth, no address of the root
        namespace is ever reachable from inside."""
        assert self.state is not None
        sock = self.root / f"fwd-{name}.sock"
        sock.unlink(missing_ok=True)
        outer = self.spawn(f"fwd-{name}-outer", ["socat", f"UNIX-LISTEN:{sock},fork,mode=600", f"TCP:127.0.0.1:{port}"])
        _wait_for(sock.exists, DAEMON_START_S, f"forwarder {name} (root side)", outer)
        self.spawn(
            f"fwd-{name}-inner",
            self.ns("socat", f"TCP-LISTEN:{port},bind={bind},fork,reuseaddr", f"UNIX-CONNECT:{sock}"),
        )
        self.state.forwards[name] = port
        self._save()

    def _make_slot(self, index: int) -> None:
        assert self.state is not None
        disks = self.root / "disks"
        disks.mkdir(exist_ok=True)
        disk_file = disks / f"slot-{index}.img"
        size = self.slot_disk_gib << 30
        with disk_file.open("wb") as f:
            f.truncate(size)  # sparse: stands for an NVMe namespace of that size, costs nothing until written
        loop = _run("losetup", "--find", "--show", str(disk_file)).stdout.strip()
        by_id = f"/dev/disk/by-id/nvme-gpuaas-lab-{self.state.netns[-8:]}-slot{index}"
        slot = LabSlot(
            index=index,
            disk_file=str(disk_file),
            loop_device=loop,
            by_id=by_id,
            mac=slot_mac(self.state.netns, index),
            private_ip=f"{BRIDGE_CIDR.split('/')[0].rsplit('.', 1)[0]}.{SLOT_IP_BASE + index}",
            size_bytes=size,
        )
        self.state.slots.append(slot)
        self._save()
        # What udev makes for an NVMe namespace on a host; here the lab makes it (this machine runs no udev).
        Path(by_id).parent.mkdir(parents=True, exist_ok=True)
        Path(by_id).unlink(missing_ok=True)
        Path(by_id).symlink_to(f"../../{Path(loop).name}")

    # --- down --------------------------------------------------------------------------------------

    def _domains(self) -> list[str]:
        assert self.state is not None
        res = _run("virsh", "-c", self.state.libvirt_uri, "list", "--all", "--name", check=False)
        return [n.strip() for n in res.stdout.splitlines() if n.strip()] if res.returncode == 0 else []

    def down(self) -> list[str]:
        """Remove everything `lab.json` names; returns what could not be removed (empty when clean)."""
        if self.state is None:
            loaded = Lab.load(self.root)
            if loaded is None:
                return []
            self.state = loaded.state
        st = self.state
        assert st is not None
        problems: list[str] = []
        if "libvirtd" in st.pids and _alive(st.pids["libvirtd"]):
            for name in self._domains():
                _run("virsh", "-c", st.libvirt_uri, "destroy", name, check=False)
                res = _run("virsh", "-c", st.libvirt_uri, "undefine", "--nvram", name, check=False)
                if res.returncode != 0:
                    problems.append(f"domain {name}: {res.stderr.strip()[:200]}")
        for name, pid in sorted(st.pids.items(), key=lambda kv: kv[0] == "virtlogd"):
            _stop_pid(pid)
            if _alive(pid):
                problems.append(f"{name} (pid {pid}) still runs")
        for slot in st.slots:
            link = Path(slot.by_id)
            if link.is_symlink():
                link.unlink()
            res = _run("losetup", "-d", slot.loop_device, check=False)
            if res.returncode != 0 and "No such device" not in res.stderr:
                # Only our own backing file is detached: a loop device re-used by someone else is left alone.
                back = _run("losetup", "--noheadings", "-O", "BACK-FILE", slot.loop_device, check=False).stdout
                if back.strip() == slot.disk_file:
                    problems.append(f"{slot.loop_device}: {res.stderr.strip()[:200]}")
            Path(slot.disk_file).unlink(missing_ok=True)
        # The reservations, leases, seeds, host keys and image cache all live under the host prefix.
        if st.host_dir and Path(st.host_dir).is_dir():
            shutil.rmtree(st.host_dir, ignore_errors=True)
        if _run("ip", "netns", "del", st.netns, check=False).returncode != 0:
            if st.netns in _run("ip", "netns", "list", check=False).stdout:
                problems.append(f"namespace {st.netns} could not be removed")
        self.state_file.unlink(missing_ok=True)
        log.info("lab_down", netns=st.netns, problems=problems)
        return problems
