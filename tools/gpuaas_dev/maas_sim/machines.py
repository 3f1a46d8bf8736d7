"""Pure state machine of one simulated MAAS machine.

No I/O and no clock of its own: every transition takes `now` (seconds on any monotonic scale) so the
timers that move Deploying -> Deployed and friends can be driven from a test without sleeping. Timed
phases are evaluated lazily by `advance(now)`, which the server calls before it reads or mutates.
"""

from __future__ import annotations

import enum
import hashlib
from dataclasses import dataclass, field, replace
from typing import Any

from .errors import BadRequest, NodeStateViolation, NoMachineAvailable


class NodeStatus(enum.IntEnum):
    NEW = 0
    COMMISSIONING = 1
    FAILED_COMMISSIONING = 2
    MISSING = 3
    READY = 4
    RESERVED = 5
    DEPLOYED = 6
    RETIRED = 7
    BROKEN = 8
    DEPLOYING = 9
    ALLOCATED = 10
    FAILED_DEPLOYMENT = 11
    RELEASING = 12
    FAILED_RELEASING = 13
    DISK_ERASING = 14
    FAILED_DISK_ERASING = 15
    RESCUE_MODE = 16
    ENTERING_RESCUE_MODE = 17
    FAILED_ENTERING_RESCUE_MODE = 18
    EXITING_RESCUE_MODE = 19
    FAILED_EXITING_RESCUE_MODE = 20
    TESTING = 21
    FAILED_TESTING = 22

    @property
    def label(self) -> str:
        return STATUS_LABELS[self]

    @property
    def filter_name(self) -> str:
        """The spelling `GET machines/?status=` accepts, e.g. `failed_deployment`."""
        return self.name.lower()


# Labels are what MAAS prints in status_name and inside its error messages; they are not derivable
# from the enum names (e.g. FAILED_RELEASING is labelled "Releasing failed").
STATUS_LABELS: dict[NodeStatus, str] = {
    NodeStatus.NEW: "New",
    NodeStatus.COMMISSIONING: "Commissioning",
    NodeStatus.FAILED_COMMISSIONING: "Failed commissioning",
    NodeStatus.MISSING: "Missing",
    NodeStatus.READY: "Ready",
    NodeStatus.RESERVED: "Reserved",
    NodeStatus.DEPLOYED: "Deployed",
    NodeStatus.RETIRED: "Retired",
    NodeStatus.BROKEN: "Broken",
    NodeStatus.DEPLOYING: "Deploying",
    NodeStatus.ALLOCATED: "Allocated",
    NodeStatus.FAILED_DEPLOYMENT: "Failed deployment",
    NodeStatus.RELEASING: "Releasing",
    NodeStatus.FAILED_RELEASING: "Releasing failed",
    NodeStatus.DISK_ERASING: "Disk erasing",
    NodeStatus.FAILED_DISK_ERASING: "Failed disk erasing",
    NodeStatus.RESCUE_MODE: "Rescue mode",
    NodeStatus.ENTERING_RESCUE_MODE: "Entering rescue mode",
    NodeStatus.FAILED_ENTERING_RESCUE_MODE: "Failed to enter rescue mode",
    NodeStatus.EXITING_RESCUE_MODE: "Exiting rescue mode",
    NodeStatus.FAILED_EXITING_RESCUE_MODE: "Failed to exit rescue mode",
    NodeStatus.TESTING: "Testing",
    NodeStatus.FAILED_TESTING: "Failed testing",
}

_RELEASE_NOOP = frozenset({NodeStatus.READY, NodeStatus.RELEASING})
_RELEASABLE = frozenset(
    {
        NodeStatus.ALLOCATED,
        NodeStatus.RESERVED,
        NodeStatus.BROKEN,
        NodeStatus.DEPLOYING,
        NodeStatus.DEPLOYED,
        NodeStatus.FAILED_DEPLOYMENT,
        NodeStatus.FAILED_DISK_ERASING,
        NodeStatus.FAILED_RELEASING,
    }
)
_COMMISSIONABLE = frozenset({NodeStatus.NEW, NodeStatus.FAILED_COMMISSIONING, NodeStatus.READY, NodeStatus.BROKEN})

# Where each timed phase ends, on success and on an injected failure.
_PHASE_OUTCOME: dict[NodeStatus, tuple[NodeStatus, NodeStatus]] = {
    NodeStatus.DEPLOYING: (NodeStatus.DEPLOYED, NodeStatus.FAILED_DEPLOYMENT),
    NodeStatus.RELEASING: (NodeStatus.READY, NodeStatus.FAILED_RELEASING),
    NodeStatus.DISK_ERASING: (NodeStatus.READY, NodeStatus.FAILED_DISK_ERASING),
    NodeStatus.COMMISSIONING: (NodeStatus.TESTING, NodeStatus.FAILED_COMMISSIONING),
    NodeStatus.TESTING: (NodeStatus.READY, NodeStatus.FAILED_TESTING),
}

_ALNUM = "0123456789abcdefghijklmnopqrstuvwxyz"


def erase_mode_of(erase: bool, secure_erase: bool, quick_erase: bool, secure_supported: bool) -> str | None:
    """The erase MAAS runs for a release's parameters (its release operation's documented rules): none without
    `erase`; the drive's secure erase where asked and the drive has one; where it has none, the quick erase when
    that was asked too, else the full overwrite; the quick erase when asked alone; else the full overwrite."""
    if not erase:
        return None
    if secure_erase and secure_supported:
        return "secure"
    return "quick" if quick_erase else "full"


def system_id_for(hostname: str) -> str:
    """Deterministic 6-char lowercase alphanumeric system_id, so fixtures and logs are stable."""
    n = int.from_bytes(hashlib.sha256(hostname.encode("utf-8")).digest()[:8], "big")
    chars = []
    for _ in range(6):
        n, r = divmod(n, len(_ALNUM))
        chars.append(_ALNUM[r])
    return "".join(chars)


@dataclass(frozen=True)
class Timers:
    """Seconds each timed phase lasts; read when a phase starts, so changes affect later phases."""

    deploying: float = 2.0
    releasing: float = 1.0
    disk_erasing: float = 1.0
    commissioning: float = 1.0
    testing: float = 1.0

    def updated(self, **changes: float) -> Timers:
        unknown = set(changes) - set(self.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown timers: {sorted(unknown)}")
        return replace(self, **{k: float(v) for k, v in changes.items()})

    def for_phase(self, status: NodeStatus) -> float:
        return {
            NodeStatus.DEPLOYING: self.deploying,
            NodeStatus.RELEASING: self.releasing,
            NodeStatus.DISK_ERASING: self.disk_erasing,
            NodeStatus.COMMISSIONING: self.commissioning,
            NodeStatus.TESTING: self.testing,
        }[status]


PHASE_NAMES: dict[str, NodeStatus] = {
    "deploying": NodeStatus.DEPLOYING,
    "releasing": NodeStatus.RELEASING,
    "disk_erasing": NodeStatus.DISK_ERASING,
    "commissioning": NodeStatus.COMMISSIONING,
    "testing": NodeStatus.TESTING,
}


@dataclass(frozen=True)
class Transition:
    at: float
    from_status: NodeStatus
    to_status: NodeStatus
    reason: str


@dataclass
class Machine:
    system_id: str
    hostname: str
    index: int = 1
    tags: set[str] = field(default_factory=set)
    status: NodeStatus = NodeStatus.READY
    status_message: str = ""
    owner: str | None = None
    agent_name: str = ""
    osystem: str = ""
    distro_series: str = ""
    hwe_kernel: str | None = None
    power_state: str = "off"
    power_type: str = "ipmi"
    architecture: str = "amd64/generic"
    cpu_count: int = 224
    memory: int = 2097152
    zone: str = "default"
    pool: str = "default"
    domain: str = "maas"
    locked: bool = False
    previous_status: NodeStatus | None = None
    phase_deadline: float | None = None
    pending_failures: dict[NodeStatus, str] = field(default_factory=dict)
    erase_mode: str | None = None
    # Whether the machine's drives have a secure erase of their own (ATA secure erase / NVMe format); MAAS falls
    # back to another erase where they do not.
    secure_erase_supported: bool = True
    last_deploy: dict[str, Any] | None = None
    # The last release MAAS took, as asked (erase, secure_erase, quick_erase) and the erase it ran: kept after the
    # machine is Ready again, so a checker reads what a release asked for.
    last_release: dict[str, Any] | None = None
    # MAAS runs the erase as the `wipe-disks` release script: the id of the result set of the last one, and its
    # exit status once the erase ended (0: Ready after it, 1: Failed disk erasing; None while it runs).
    current_release_result_id: int = 0
    erase_exit_status: int | None = None
    history: list[Transition] = field(default_factory=list)
    # Every deploy MAAS committed (its agent_name and time): a checker counts deploys per allocation.
    deploys: list[dict[str, Any]] = field(default_factory=list)
    # MAAS creates a new commissioning result set for every run; clients tell a finished run from
    # one that never started by comparing this id with the one seen before asking.
    current_commissioning_result_id: int = 0
    commissioning_scripts: tuple[str, ...] = ()
    # What the slice firmware preflight prints on this machine's next commissioning runs: check name ->
    # failing detail ("" for the default), or the whole stdout and exit status (tests and /_sim/).
    preflight_failures: dict[str, str] = field(default_factory=dict)
    preflight_output: str | None = None
    preflight_exit_status: int | None = None
    # The `virsh` power driver's parameters (virsh_power.VirshParams); None: the timer-driven simulation.
    virsh: Any = None
    # The address MAAS assigned the machine (a static link); None: a loopback address of its own.
    static_ip: str | None = None
    # `set_storage_layout`'s last layout: curtin lays the disk out by it at the next deploy.
    storage_layout: str = "lvm"

    # ---- derived facts -------------------------------------------------------------------------

    @property
    def fqdn(self) -> str:
        return f"{self.hostname}.{self.domain}"

    @property
    def ip_address(self) -> str:
        if self.static_ip:
            return self.static_ip
        # Loopback addresses keep any accidental traffic from a simulated host on this machine.
        return f"127.0.{10 + self.index // 250}.{1 + self.index % 250}"

    @property
    def mac_address(self) -> str:
        digest = hashlib.sha256(self.system_id.encode()).digest()
        return "52:54:00:" + ":".join(f"{b:02x}" for b in digest[:3])

    # ---- transitions ---------------------------------------------------------------------------

    def _move(self, now: float, to: NodeStatus, reason: str, message: str | None = None) -> None:
        self.history.append(Transition(now, self.status, to, reason))
        self.status = to
        self.status_message = message if message is not None else to.label
        if to in (
            NodeStatus.DEPLOYING,
            NodeStatus.COMMISSIONING,
            NodeStatus.TESTING,
            NodeStatus.DISK_ERASING,
            NodeStatus.DEPLOYED,
        ):
            self.power_state = "on"
        elif to in (NodeStatus.READY, NodeStatus.NEW, NodeStatus.ALLOCATED):
            self.power_state = "off"

    def _start_phase(self, now: float, timers: Timers, phase: NodeStatus, reason: str) -> None:
        self._move(now, phase, reason)
        self.phase_deadline = now + timers.for_phase(phase)

    def inject_failure(self, phase: str | NodeStatus, message: str) -> None:
        """Make the next run of `phase` end in its failed state (e.g. Failed deployment)."""
        status = PHASE_NAMES[phase] if isinstance(phase, str) else phase
        if status not in _PHASE_OUTCOME:
            raise ValueError(f"{phase!r} is not a timed phase")
        self.pending_failures[status] = message

    def advance(self, now: float, timers: Timers) -> None:
        """Complete every timed phase whose deadline has passed by `now`."""
        while self.phase_deadline is not None and now >= self.phase_deadline:
            deadline = self.phase_deadline
            phase = self.status
            self.phase_deadline = None
            ok_status, failed_status = _PHASE_OUTCOME[phase]
            failure = self.pending_failures.pop(phase, None)
            self._erase_ended(phase, failure)
            if failure is not None:
                self._move(deadline, failed_status, "timer", failure)
                continue
            if ok_status is NodeStatus.TESTING:
                # Testing is timed from the end of commissioning, not from `now`, so a late poll
                # sees the same outcome as a prompt one.
                self._move(deadline, NodeStatus.TESTING, "timer")
                self.phase_deadline = deadline + timers.testing
                continue
            if ok_status is NodeStatus.READY:
                self._clear_ownership()
            self._move(deadline, ok_status, "timer")

    def phase_token(self) -> int:
        """Names the phase now running: a power driver's outcome applies only to the phase it was started for."""
        return len(self.history)

    def finish_phase(self, now: float, token: int, failure: str | None = None) -> bool:
        """Ends an untimed phase (a power driver's deploy, release or erase) where its outcome leads."""
        phase = self.status
        if token != len(self.history) or phase not in _PHASE_OUTCOME or self.phase_deadline is not None:
            return False  # released or aborted meanwhile: the driver's outcome no longer applies
        ok_status, failed_status = _PHASE_OUTCOME[phase]
        self._erase_ended(phase, failure)
        if failure is not None:
            self._move(now, failed_status, "power", failure)
            return True
        if ok_status is NodeStatus.READY:
            self._clear_ownership()
        self._move(now, ok_status, "power")
        return True

    def _erase_ended(self, phase: NodeStatus, failure: str | None) -> None:
        if phase is NodeStatus.DISK_ERASING:
            self.erase_exit_status = 1 if failure is not None else 0

    def _clear_ownership(self) -> None:
        self.owner = None
        self.agent_name = ""
        self.osystem = ""
        self.distro_series = ""
        self.hwe_kernel = None
        self.erase_mode = None

    def allocate(self, now: float, owner: str, agent_name: str = "", comment: str | None = None) -> None:
        if self.status is not NodeStatus.READY or self.owner is not None or self.locked:
            raise NoMachineAvailable(f"No machine with system ID {self.system_id} available.")
        self.owner = owner
        self.agent_name = agent_name or ""
        self._move(now, NodeStatus.ALLOCATED, "allocate")

    def deploy(
        self,
        now: float,
        timers: Timers,
        *,
        owner: str,
        osystem: str,
        distro_series: str,
        user_data: bytes | None = None,
        hwe_kernel: str | None = None,
        agent_name: str | None = None,
        comment: str | None = None,
    ) -> None:
        if self.status is NodeStatus.READY and self.owner is None and not self.locked:
            self.allocate(now, owner, agent_name or "", comment)
        elif self.status is not NodeStatus.ALLOCATED:
            raise NodeStateViolation(f"Can't deploy a machine that is in the '{self.status.label}' state")
        if agent_name:
            self.agent_name = agent_name
        self.osystem = osystem
        self.distro_series = distro_series
        self.hwe_kernel = hwe_kernel
        self.deploys.append({"agent_name": agent_name or "", "at": now})
        self.last_deploy = {
            "at": now,
            "osystem": osystem,
            "distro_series": distro_series,
            "hwe_kernel": hwe_kernel,
            "user_data": user_data,
            "comment": comment,
            "storage_layout": self.storage_layout,
        }
        self._start_phase(now, timers, NodeStatus.DEPLOYING, "deploy")
        if self.virsh is not None:
            self.phase_deadline = None  # the power driver ends it

    def release(
        self,
        now: float,
        timers: Timers,
        *,
        erase: bool = False,
        quick_erase: bool = False,
        secure_erase: bool = False,
        comment: str | None = None,
    ) -> None:
        if self.status in _RELEASE_NOOP:
            return
        if self.status not in _RELEASABLE:
            raise NodeStateViolation(f"Machine cannot be released in its current state ('{self.status.label}').")
        self.phase_deadline = None
        # MAAS drops the deploy's failure plan too: a release is a fresh start.
        self.pending_failures.pop(NodeStatus.DEPLOYING, None)
        # As MAAS: only `erase` erases; `secure_erase` and `quick_erase` choose how (the handler has put the
        # region's global settings in for the flags the caller left out).
        self.erase_mode = erase_mode_of(erase, secure_erase, quick_erase, self.secure_erase_supported)
        self.last_release = {
            "at": now,
            "erase": erase,
            "secure_erase": secure_erase,
            "quick_erase": quick_erase,
            "erase_mode": self.erase_mode,
            "comment": comment,
        }
        if self.erase_mode is not None:
            self.erase_exit_status = None
            self._start_phase(now, timers, NodeStatus.DISK_ERASING, "release")
        else:
            self._start_phase(now, timers, NodeStatus.RELEASING, "release")
        if self.virsh is not None:
            self.phase_deadline = None

    def commission(self, now: float, timers: Timers, scripts: tuple[str, ...] = ()) -> None:
        if self.status not in _COMMISSIONABLE:
            raise BadRequest({"__all__": ["Commission is not available because of the current state of the node."]})
        self.previous_status = self.status
        self.current_commissioning_result_id += 1
        self.commissioning_scripts = tuple(scripts)
        self._start_phase(now, timers, NodeStatus.COMMISSIONING, "commission")

    def abort(self, now: float, comment: str | None = None) -> None:
        target = {
            NodeStatus.COMMISSIONING: NodeStatus.NEW,
            NodeStatus.DEPLOYING: NodeStatus.ALLOCATED,
            NodeStatus.DISK_ERASING: NodeStatus.FAILED_DISK_ERASING,
            # Testing goes back to where the machine was before commissioning started.
            NodeStatus.TESTING: self.previous_status or NodeStatus.NEW,
        }.get(self.status)
        if target is None:
            raise NodeStateViolation(
                f"Cannot abort in current state: node {self.system_id} is in state {self.status.label}."
            )
        self.pending_failures.pop(self.status, None)
        self._erase_ended(self.status, "aborted")
        self.phase_deadline = None
        self._move(now, target, "abort")

    # ---- wire shape ----------------------------------------------------------------------------

    def to_json(self, api_root: str = "/MAAS/api/2.0/") -> dict[str, Any]:
        return {
            "system_id": self.system_id,
            "hostname": self.hostname,
            "fqdn": self.fqdn,
            "domain": {"name": self.domain, "id": 0},
            "node_type": 0,
            "node_type_name": "Machine",
            "status": int(self.status),
            "status_name": self.status.label,
            "status_message": self.status_message,
            "status_action": "",
            "owner": self.owner,
            "owner_data": {},
            "osystem": self.osystem,
            "distro_series": self.distro_series,
            "hwe_kernel": self.hwe_kernel,
            "min_hwe_kernel": "",
            "netboot": self.status not in (NodeStatus.DEPLOYED,),
            "power_state": self.power_state,
            "power_type": self.power_type,
            "tag_names": sorted(self.tags),
            "ip_addresses": [self.ip_address],
            "boot_interface": {"mac_address": self.mac_address, "name": "eno1"},
            "architecture": self.architecture,
            "cpu_count": self.cpu_count,
            "memory": self.memory,
            "zone": {"name": self.zone, "id": 1, "description": ""},
            "pool": {"name": self.pool, "id": 0, "description": "Default pool"},
            "locked": self.locked,
            "current_commissioning_result_id": self.current_commissioning_result_id or None,
            "disable_ipv4": False,
            "resource_uri": f"{api_root}machines/{self.system_id}/",
        }
