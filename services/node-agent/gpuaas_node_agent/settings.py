from pathlib import Path, PurePosixPath
from typing import Any, Literal

from pydantic import Field, field_validator

from gpuaas_common.settings import EnvList, ServiceSettings


class AgentSettings(ServiceSettings):
    # The id of the host this agent runs on (its inventory node id); the agent refuses to start without it.
    node_id: str | None = None
    # `slice_host`, `baremetal`, or `auto`: baremetal where the deploy's cloud-init wrote
    # /etc/gpuaas/node-agent.env (under GPUAAS_HOST_ROOT), slice host otherwise. A baremetal agent takes its
    # node id, allocation, enrolment token and creds from that file; a setting that contradicts it is refused.
    role: Literal["auto", "slice_host", "baremetal"] = "auto"
    # A baremetal host announces its enrolment again after each of these pauses (the last one repeating): no
    # answer from the allocator reaches it, and an allocator that lost its commit can only learn it again so.
    enrolment_announce_again_s: EnvList[float] = (20.0, 40.0, 80.0, 160.0, 320.0, 600.0)
    # How long after start a baremetal host keeps announcing (the allocator's enrolment deadline, 30 min by
    # default, has passed by then: the allocation is active or failed).
    enrolment_announce_for_s: float = Field(default=1800.0, gt=0)
    # Root of the host's filesystem as the agent sees it: "/" on a real host, a fixture tree in tests.
    host_root: str = "/"
    # The host's libvirt; the simulated fleet uses libvirt's test driver (test:///default).
    libvirt_uri: str = "qemu:///system"
    # libvirt domain type of slice VMs. `kvm` on GPU hosts; `qemu` (TCG, emulated: slow, no passthrough) where
    # KVM cannot run guests, as in the lab; `auto` probes the host and logs which it chose and why.
    domain_type: Literal["kvm", "qemu", "auto"] = "kvm"
    # What the slot's `ovs_bridge` is: an Open vSwitch bridge (production) or a Linux bridge (the lab).
    bridge_kind: Literal["openvswitch", "linux"] = "openvswitch"
    # Readiness is a real SSH login by the agent's own key against the host key the seed planted, with
    # cloud-init done, that reads the guest's GPU report for the GPU check. Off only for the simulated fleet,
    # whose guests are an SSH banner and no machine (the fleet's own simulator answers the login instead).
    readiness_login: bool = True
    # The user cloud-init creates in the guest for the tenant's keys (and the agent's readiness key).
    guest_user: str = Field(default="gpuaas", pattern=r"^[a-z_][a-z0-9_-]{0,31}$")
    # The user the seed creates for the slice terminal's relay key alone: no sudo, no group, not root, not
    # `guest_user`. The console logs in as it.
    console_user: str = Field(default="gpuaas-console", pattern=r"^[a-z_][a-z0-9_-]{0,31}$")
    # The agent's task records (SQLite), which survive restarts.
    state_dir: str = "/var/lib/gpuaas/agent"
    # The guests' SSH port, probed before a slice is reported ready.
    ssh_port: int = Field(default=22, ge=1, le=65535)
    # How long a new slice VM has to take a DHCP lease and answer on SSH.
    readiness_timeout_s: float = Field(default=120.0, gt=0)
    # How long a released VM may take to shut down before it is destroyed.
    shutdown_timeout_s: float = Field(default=30.0, gt=0)
    # Prewarmed slice images (`<dir>/<slug>.raw`).
    image_cache_dir: str = "/var/lib/gpuaas/slice-images"
    # dnsmasq's --dhcp-hostsdir: one reservation file per slice VM.
    dnsmasq_hostsdir: str = "/etc/gpuaas/dnsmasq-hosts"
    # dnsmasq's lease file, read to learn a guest's address.
    dnsmasq_lease_file: str = "/var/lib/misc/dnsmasq.leases"
    # cloud-init NoCloud seed ISOs of the slice VMs.
    seed_dir: str = "/var/lib/gpuaas/seeds"
    # The GPU bridge's address the parity run expects (runbook: ovsbr0 10.100.0.1/24, dnsmasq and NAT on its /24).
    gpu_bridge_cidr: str = "10.100.0.1/24"
    # The GPU bridge's name (runbook: ovsbr0; the lab's Linux bridge is gpubr0): discovery and parity read it.
    gpu_bridge: str = Field(default="ovsbr0", pattern=r"^[A-Za-z0-9_.-]{1,15}$")
    # The runbook counts tmfifo_net0 and the BlueField-3 peer as optional management evidence: parity reports
    # them as WARN. A site whose operations depend on the BF3 management link makes them FAIL instead.
    parity_require_bf3_management: bool = False
    # Emulated slots: block devices (by-id paths) this host offers as slots with no GPU and no fabric VF. Only
    # a lab host under QEMU/TCG has them; discovery reports them as `emulated` candidates, parity runs its
    # emulated profile (hardware checks not applicable), and the scheduler approves them only where its own
    # setting allows. Empty on every GPU host.
    emulated_slot_disks: EnvList[str] = ()
    # Agent-owned host directories kept elsewhere, `HOST_DIR=AGENT_DIR` (the lab keeps /var/lib/gpuaas/... under
    # its prefix); tasks and the catalog keep speaking the runbook paths.
    host_path_map: EnvList[str] = ()
    # How long JetStream waits for a task's ack or progress ack before redelivering it. A slice provision takes
    # minutes, but the bus sends progress acks while it runs: this only bounds how long a dead agent holds it.
    task_ack_wait_s: float = Field(default=5.0, gt=0)
    # Tasks handled in parallel per host (on disjoint slots).
    task_concurrency: int = Field(default=8, ge=1, le=64)
    # Seconds between reconciler passes (host against the task records, drift reported to the scheduler);
    # one pass also runs at start.
    reconcile_interval_s: float = Field(default=300.0, gt=0)

    @field_validator("console_user")
    @classmethod
    def _console_user_of_its_own(cls, v: str, info: Any) -> str:
        # (The seed refuses root too; a test's stand-in guest, a local sshd, may only have the user running it.)
        if v == info.data.get("guest_user"):
            raise ValueError("must be a user of its own, not GPUAAS_GUEST_USER (which has sudo)")
        return v

    @field_validator("emulated_slot_disks")
    @classmethod
    def _by_id_paths(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        bad = [v for v in value if not v.startswith("/dev/disk/by-id/") or ".." in v]
        if bad:
            raise ValueError(f"emulated slot disks must be /dev/disk/by-id/ paths: {', '.join(bad)}")
        return value

    @field_validator("host_path_map")
    @classmethod
    def _path_map(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        parse_path_map(value)
        return value

    @field_validator("enrolment_announce_again_s")
    @classmethod
    def _pauses_positive(cls, value: tuple[float, ...]) -> tuple[float, ...]:
        if any(p <= 0 for p in value):
            raise ValueError("every pause must be more than 0 s")
        return value


def parse_path_map(entries: tuple[str, ...] | list[str]) -> tuple[tuple[str, Path], ...]:
    """`HOST_DIR=AGENT_DIR` entries, both absolute; a malformed one is a configuration error."""
    out = []
    for entry in entries:
        host_dir, sep, agent_dir = entry.partition("=")
        if not sep or not host_dir.startswith("/") or not agent_dir.startswith("/") or ".." in entry.split("/"):
            raise ValueError(f"host path map entry {entry!r} is not HOST_DIR=AGENT_DIR with two absolute paths")
        out.append((str(PurePosixPath(host_dir)), Path(agent_dir)))
    return tuple(out)
