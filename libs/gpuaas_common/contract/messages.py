"""Payload models of every message in the contract.

`contracts/asyncapi.yaml` is rendered from these models and a test fails when the two drift apart.
Payloads forbid unknown fields: a typo in a producer is a contract break, not silently dropped data.
"""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

Shape = Literal["gpu_slice", "baremetal"]
AllocationState = Literal[
    "accepted",
    "placed",
    "provisioning",
    "active",
    "releasing",
    "released",
    "unschedulable",
    "failed",
]
# The two states an allocation ends in once it was accepted.
AllocationEnd = Literal["released", "failed"]
Slug = Field(min_length=1, max_length=128, pattern=r"^[a-z0-9][a-z0-9._-]*$")
Identifier = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._:-]*$")
Sha256 = Field(pattern=r"^[0-9a-f]{64}$")
PciAddress = Field(pattern=r"^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")
MacAddress = Field(pattern=r"^[0-9a-f]{2}(:[0-9a-f]{2}){5}$")
# An NVIDIA driver version as nvidia-smi and nv-fabricmanager print it (580.159.04).
DriverVersion = Field(default=None, pattern=r"^[0-9]+(\.[0-9]+){1,3}$", max_length=32)
# A GPU's module ID on an 8-GPU HGX board (nvidia-smi -q "Module Id"), the numbering NVLink partitions use.
ModuleId = Field(default=None, ge=1, le=8)
# A Fabric Manager partition id of the HGX H200 default table (0-14); None: no partition (an older scheduler, a
# host whose slots carry no module IDs, an emulated slot).
NvlinkPartition = Field(default=None, ge=0, le=14)
# A site's destructive wipe between tenants (slice-implementation-checklist: "blkdiscard, nvme format, or
# site-specific secure erase path before any released slot can be reused").
WipePolicy = Literal["blkdiscard", "nvme_format", "crypto_erase"]
# How an image's guest gets its NVIDIA driver (slice-image-pipeline): baked into the image, or installed by
# cloud-init at first boot. The catalog's default is preinstalled, and so is an older producer's silence.
DriverStrategy = Literal["preinstalled", "cloud_init"]
# How MAAS erases a released machine's disks (its release's `secure_erase`; never `quick_erase`, which wipes only
# 2 MiB at each end of a disk and leaves the tenant's data readable): `secure` asks for the drive's own secure
# erase, `full` overwrites every block. The allocator derives it from the site's wipe policy (domain/erase.py).
EraseMode = Literal["secure", "full"]
# What MAAS showed of the erase: `erased` (the machine went through Disk erasing to Ready), `failed` (Failed disk
# erasing), `unconfirmed` (Ready, but no poll or answer ever showed Disk erasing: nothing proves the erase ran).
EraseOutcome = Literal["erased", "failed", "unconfirmed"]


class Payload(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# --- shared pieces -----------------------------------------------------------------------------


class ImageRef(Payload):
    slug: str = Slug
    digest_sha256: str = Sha256
    image_path: str = Field(min_length=1, max_length=1024)
    # The agent's guest GPU check asks a working driver of a preinstalled image, only the GPUs of a cloud_init one.
    driver_strategy: DriverStrategy = "preinstalled"
    # The NVIDIA driver inside the guest, from the image catalog: a host placing NVLink partitions serves the image
    # only when its Fabric Manager has exactly this version. None: the catalog names none, no gate.
    driver_version: str | None = DriverVersion


class SlotBinding(Payload):
    """One approved slot bundle as the scheduler hands it to the node that will use it."""

    slot_id: str = Identifier
    # None only on a lab host, which has no GPU to pass through and says so rather than naming a pretend one.
    gpu_pci_address: str | None = PciAddress
    nvme_by_id: str = Field(min_length=1, max_length=1024)
    fabric_vf_pci_address: str | None = PciAddress
    mac: str = MacAddress
    private_ip: str = Field(min_length=7, max_length=45)
    ovs_bridge: str = Field(min_length=1, max_length=64)
    numa_node: int | None = Field(default=None, ge=0)
    profile: str = Identifier
    # The wipe the agent must use on this slot's disk, from the site's policy at placement; absent from older
    # schedulers, when the agent uses its default (blkdiscard or, on a file stand-in, zero fill).
    wipe_policy: WipePolicy | None = None
    # The GPU's module ID on the HGX board; None on a slot approved from older evidence or an emulated one.
    module_id: int | None = ModuleId


class GuestGpus(Payload):
    """What the guest's readiness unit saw, against what the slot group passed through (the agent's check)."""

    expected: int = Field(ge=0, le=8)
    # GPUs on the guest's PCI bus (NVIDIA 3D controllers), and those nvidia-smi listed when the driver answered.
    pci: int = Field(ge=0)
    driver: int | None = Field(default=None, ge=0)
    driver_state: Literal["loaded", "absent", "failed"]
    driver_version: str | None = Field(default=None, max_length=64)
    driver_strategy: DriverStrategy


class Readiness(Payload):
    mac: str = MacAddress
    expected_ip: str
    actual_ip: str | None = None
    lease_state: Literal["bound", "absent", "mismatch"]
    ssh_ready: bool
    # What a tenant needs to log in and to trust the first connection: the guest's user and SSH port, and the
    # fingerprint of the host key the seed planted, which the agent's own login matched (OpenSSH's SHA256:…).
    ssh_user: str | None = Field(default=None, max_length=32)
    ssh_port: int | None = Field(default=None, ge=1, le=65535)
    host_key_fingerprint: str | None = Field(default=None, pattern=r"^SHA256:[A-Za-z0-9+/]{43}$")
    # Seconds each provisioning phase took on the host (clone, seed, define, boot, lease, cloud_init, ssh).
    phase_seconds: dict[str, float] = Field(default_factory=dict)
    # Absent from older agents, which did not ask the guest.
    guest_gpus: GuestGpus | None = None


class WipeProof(Payload):
    device: str = Field(min_length=1, max_length=1024)
    method: str = Field(min_length=1, max_length=64)
    verified: bool
    signatures: list[str] = Field(default_factory=list)
    detail: str | None = None
    # What the agent checked after the wipe (signature scan, sampled blocks read back), in words for the audit.
    verification: str | None = Field(default=None, max_length=1024)


class CleanupReport(Payload):
    required: bool
    verified: bool
    wipe_proofs: list[WipeProof] = Field(default_factory=list)
    reason: str | None = None


class MachineErase(Payload):
    """A baremetal release's MAAS erase, as the gateway's result reported it: kept on the allocation's timeline."""

    operation_id: str = Identifier
    mode: EraseMode | None = None
    outcome: EraseOutcome | None = None
    maas_status_name: str | None = None


class AccessInfo(Payload):
    ip: str | None = None
    mac: str | None = None
    ssh_ready: bool | None = None
    maas_system_id: str | None = None
    port: int | None = Field(default=None, ge=1, le=65535)
    user: str | None = Field(default=None, max_length=32)
    host_key_fingerprint: str | None = Field(default=None, pattern=r"^SHA256:[A-Za-z0-9+/]{43}$")


# --- portal input ------------------------------------------------------------------------------


class AllocationRequested(Payload):
    allocation_id: uuid.UUID
    tenant_id: str = Identifier
    shape: Shape
    sku: str = Field(min_length=1, max_length=64)
    gpu_count: int = Field(default=8, ge=1, le=64)
    image: str = Slug
    region: str = Field(default="default", min_length=1, max_length=64)
    ssh_public_keys: list[str] = Field(default_factory=list, max_length=16)
    hostname: str | None = Field(default=None, max_length=63, pattern=r"^[a-z0-9]([a-z0-9-]*[a-z0-9])?$")


class AllocationReleaseRequested(Payload):
    allocation_id: uuid.UUID
    reason: str | None = Field(default=None, max_length=512)


# --- allocation queries (portals, ops -> allocator, request/reply over core NATS) ----------------------

# Stored states: `requested` never leaves the allocator's transaction, but a row may be read in it.
QueryState = Literal[
    "requested",
    "accepted",
    "placed",
    "provisioning",
    "active",
    "releasing",
    "released",
    "unschedulable",
    "failed",
]


class AllocationQuery(Payload):
    """Read allocations from their owner: one by id (with its timeline), or the newest that match every
    filter given. Nothing is stored or changed; the answer goes to the request's reply subject."""

    allocation_id: uuid.UUID | None = None
    tenant_id: str | None = Field(default=None, min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._:-]*$")
    state: QueryState | None = None
    node_id: str | None = Field(default=None, min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._:-]*$")
    # Any of these ids (a batch read, no timeline): the scheduler's claim audit asks about the allocations it
    # holds claims for; an id the allocator never accepted is simply absent from `allocations`.
    allocation_ids: list[uuid.UUID] | None = Field(default=None, min_length=1, max_length=1000)
    limit: int = Field(default=100, ge=1, le=1000)

    @model_validator(mode="after")
    def _one_way_to_name_ids(self) -> AllocationQuery:
        if self.allocation_id is not None and self.allocation_ids is not None:
            raise ValueError("give allocation_id or allocation_ids, not both")
        return self


class AllocationSummary(Payload):
    allocation_id: uuid.UUID
    tenant_id: str
    shape: Shape
    sku: str
    gpu_count: int = Field(ge=1, le=64)
    region: str
    image: str
    state: QueryState
    node_id: str | None = None
    access: AccessInfo | None = None
    failure_code: str | None = None
    failure_reason: str | None = None
    created_at: datetime
    updated_at: datetime


class TimelineEntry(Payload):
    seq: int = Field(ge=1)
    state: str
    previous_state: str | None = None
    reason_code: str | None = None
    at: datetime
    detail: dict[str, object] = Field(default_factory=dict)


class AllocationQueryResult(Payload):
    """`found` lists the matches, newest first (none is still `found` for a filtered list); `not_found`
    answers an id the allocator never accepted; `invalid` a request that broke the contract (`reason` says
    how). `truncated`: more matched than `limit`. The timeline is filled only for a query by id."""

    status: Literal["found", "not_found", "invalid"]
    reason: str | None = Field(default=None, max_length=2048)
    allocations: list[AllocationSummary] = Field(default_factory=list)
    timeline: list[TimelineEntry] = Field(default_factory=list)
    truncated: bool = False


# --- allocation lifecycle (allocator -> ops, portals, scheduler) --------------------------------


class AllocationEvent(Payload):
    allocation_id: uuid.UUID
    tenant_id: str = Identifier
    shape: Shape
    state: AllocationState
    previous_state: str | None = None
    seq: int = Field(ge=1, description="Position of this transition in the allocation's timeline")


class AllocationAccepted(AllocationEvent):
    sku: str
    gpu_count: int = Field(ge=1, le=64)
    region: str
    image: ImageRef


class AllocationRejected(Payload):
    """A request that never became an allocation; nothing about it is stored."""

    allocation_id: uuid.UUID
    tenant_id: str | None = None
    shape: Shape | None = None
    reason_code: str = Identifier
    reason: str = Field(max_length=2048)


class AllocationReleaseRejected(Payload):
    """A release request the allocator could not act on, answered at once so the asker need not wait.

    `already_releasing` is not a failure: a release is under way and `allocation.released` will follow."""

    allocation_id: uuid.UUID
    tenant_id: str | None = None
    shape: Shape | None = None
    state: AllocationState | None = Field(default=None, description="The allocation's state; none if unknown")
    reason_code: Literal["unknown_allocation", "already_releasing", "already_released", "not_releasable"]
    reason: str = Field(max_length=2048)


class AllocationPlaced(AllocationEvent):
    node_id: str = Identifier
    claim_mode: Literal["slots", "node_exclusive"]
    slots: list[SlotBinding] = Field(default_factory=list)
    maas_system_id: str | None = None


class AllocationUnschedulable(AllocationEvent):
    reason_code: str = Identifier
    reason: str = Field(max_length=2048)
    filtered: dict[str, int] = Field(default_factory=dict)
    free_gpus: int = Field(ge=0)
    requested_gpus: int = Field(ge=1)


class AllocationProvisioning(AllocationEvent):
    node_id: str = Identifier
    task_id: str | None = None
    operation_id: str | None = None


class AllocationActive(AllocationEvent):
    node_id: str = Identifier
    access: AccessInfo


class AllocationReleasing(AllocationEvent):
    reason: str | None = None


class AllocationReleased(AllocationEvent):
    node_id: str | None = None
    cleanup: CleanupReport
    # A baremetal machine's MAAS release: the erase asked and what MAAS showed of it. None for a slice.
    machine_erase: MachineErase | None = None


class AllocationFailed(AllocationEvent):
    reason_code: str = Identifier
    reason: str = Field(max_length=2048)
    node_id: str | None = None
    # True unless the attempt provably never wrote a slot's disk: the slots then return to service only on wipe
    # proofs the scheduler accepts under the site's policy (these, or a repair's), else wait in cleanup_blocked.
    cleanup_required: bool
    # Wipes the host made before giving up (a provision a restart interrupted), passed on unjudged.
    wipe_proofs: list[WipeProof] = Field(default_factory=list)
    # A failed MAAS release of the machine (its erase failed or is unproven): the erase asked and what MAAS showed.
    machine_erase: MachineErase | None = None


# --- scheduler -> allocator ----------------------------------------------------------------------


class PlacementPlaced(Payload):
    allocation_id: uuid.UUID
    node_id: str = Identifier
    claim_mode: Literal["slots", "node_exclusive"]
    fencing_epoch: int = Field(ge=1)
    slots: list[SlotBinding] = Field(default_factory=list)
    maas_system_id: str | None = None
    # The Fabric Manager partition the slots form, which the node agent activates before the VM starts.
    nvlink_partition: int | None = NvlinkPartition
    # A node held whole: its site's wipe policy at placement (the scheduler's default when the site sets none),
    # which the machine's MAAS erase at release follows. None from older schedulers and on a slice placement,
    # whose slots carry their own.
    wipe_policy: WipePolicy | None = None


class PlacementForceReleased(Payload):
    """An operator freed an allocation's claims by force: its slots are `cleanup_blocked` (a VM may still hold
    them, the disks may hold tenant data), its node drained if it held one whole; the allocation must end."""

    allocation_id: uuid.UUID
    node_ids: list[str] = Field(default_factory=list)
    slot_ids: list[str] = Field(default_factory=list)
    actor: str = Field(min_length=1, max_length=128)
    reason: str = Field(min_length=1, max_length=500)
    forced: bool
    holders: list[str] = Field(default_factory=list, description="Why the VM may still hold the devices")


HostMode = Literal["slice", "baremetal", "converting", "drained", "retired"]


class HostModeChanged(Payload):
    """A host's mode changed (the scheduler's host-mode machine): who moved it, why, when. What a host's mode means
    to others: a retired or baremetal host is no slice host the image activation gate waits for."""

    node_id: str = Identifier
    from_mode: HostMode
    to_mode: HostMode
    actor: str = Field(min_length=1, max_length=128)
    reason: str = Field(min_length=1, max_length=500)
    changed_at: datetime


SlotStatus = Literal[
    "disabled",
    "available",
    "reserved",
    "provisioning",
    "active",
    "releasing",
    "cleanup",
    "cleanup_blocked",
    # Approved, but its disk may hold someone else's data (a host back from a baremetal tenancy, a re-approval,
    # a new disk): placeable only once its own host's agent proves the site's wipe (node.slot_wipe_reported).
    "awaiting_wipe",
    "retired",
]
SlotHealth = Literal["unknown", "healthy", "degraded", "failed"]
SlotsChangeCause = Literal[
    "approval",
    "retire",
    "disable",
    "repair",
    "release",
    "failure",
    "force_release",
    "claim_audit",
    "wipe",
    # A host back from maintenance: its free slots await its wipe proof.
    "maintenance",
]


class SlotState(Payload):
    """One slot of a host as the scheduler holds it: its binding, status and health, and why."""

    slot_id: str = Field(min_length=1, max_length=128)
    status: SlotStatus
    status_reason: str | None = Field(default=None, max_length=500)
    health_state: SlotHealth
    health_detail: str | None = Field(default=None, max_length=500)
    profile: str = Field(min_length=1, max_length=128)
    # None on a lab host's emulated slot, which has no GPU to pass through.
    gpu_pci_address: str | None = Field(default=None, max_length=64)
    nvme_by_id: str | None = Field(default=None, max_length=1024)
    private_ip: str | None = Field(default=None, max_length=45)
    updated_at: datetime


class SlotsChanged(Payload):
    """A host's slots changed outside placement (approval, retire, disable, repair, a return from maintenance; a
    release or failure that left a slot `cleanup_blocked`; a force-release; the claim audit; a host's wipe
    report): every slot of the host as it is now. The
    scheduler numbers each host's announcements (`generation`, growing by one each): a reader keeps the highest
    it has read and ignores an older one. Claims and releases of a healthy slot are not announced here; the
    lifecycle events carry them."""

    node_id: str = Identifier
    generation: int = Field(ge=1)
    cause: SlotsChangeCause
    actor: str = Field(min_length=1, max_length=128)
    slots: list[SlotState] = Field(default_factory=list, max_length=256)

    @model_validator(mode="after")
    def _one_entry_per_slot(self) -> SlotsChanged:
        ids = [s.slot_id for s in self.slots]
        if len(set(ids)) != len(ids):
            raise ValueError("a slot is listed twice")
        return self


class PlacementUnschedulable(Payload):
    allocation_id: uuid.UUID
    reason_code: str = Identifier
    reason: str = Field(max_length=2048)
    filtered: dict[str, int] = Field(default_factory=dict)
    free_gpus: int = Field(ge=0)
    requested_gpus: int = Field(ge=1)


# --- node tasks (allocator -> node agent) and reports (node agent -> allocator) ------------------


class SliceVmProvision(Payload):
    task_id: str = Identifier
    allocation_id: uuid.UUID
    node_id: str = Identifier
    fencing_epoch: int = Field(ge=1)
    deadline: datetime
    vm_name: str = Identifier
    slots: list[SlotBinding] = Field(min_length=1, max_length=8)
    # Activated after the slots' GPUs are reset and before the VM starts; None: no partition to activate.
    nvlink_partition: int | None = NvlinkPartition
    image: ImageRef
    ssh_public_keys: list[str] = Field(default_factory=list, max_length=16)
    hostname: str = Field(min_length=1, max_length=63)


class SliceVmRelease(Payload):
    task_id: str = Identifier
    allocation_id: uuid.UUID
    node_id: str = Identifier
    fencing_epoch: int = Field(ge=1)
    deadline: datetime
    vm_name: str = Identifier
    slots: list[SlotBinding] = Field(min_length=1, max_length=8)
    # Deactivated after the VM is shut down, then the GPUs reset.
    nvlink_partition: int | None = NvlinkPartition


class NodeTaskProgress(Payload):
    task_id: str = Identifier
    allocation_id: uuid.UUID
    node_id: str = Identifier
    task_type: str = Identifier
    phase: str = Identifier
    detail: str | None = None


class NodeTaskResult(Payload):
    task_id: str = Identifier
    allocation_id: uuid.UUID
    node_id: str = Identifier
    task_type: str = Identifier
    status: Literal["succeeded", "failed", "refused"]
    reason_code: str | None = None
    reason: str | None = None
    readiness: Readiness | None = None
    wipe_proofs: list[WipeProof] = Field(default_factory=list)
    # The agent's own account: a wipe it owes could not be done or verified, so ops must act.
    cleanup_required: bool = False
    # False only when the agent's durable record of the task shows no step that writes a slot's disk was ever
    # entered, by this run or one before a restart; absent counts as touched.
    disk_touched: bool = True
    # A release's account of how the VM stopped: `graceful` (ACPI within the timeout), `forced` (the timeout
    # passed and the agent pulled the plug), `already_off`, or `absent` (no domain). None on a provision.
    stop_path: Literal["graceful", "forced", "already_off", "absent"] | None = None


class NodeEnrolled(Payload):
    node_id: str = Identifier
    kind: Literal["slice_host", "baremetal"]
    hostname: str = Field(min_length=1, max_length=253)
    agent_version: str
    maas_system_id: str | None = None
    allocation_id: uuid.UUID | None = None
    enrolment_proof: str | None = Field(default=None, pattern=r"^[0-9a-f]{64}$")
    # Seconds from the host's kernel start to this announcement (its uptime): a baremetal host's first boot,
    # measured on its own clock. Absent from slice hosts and older agents.
    boot_seconds: float | None = Field(default=None, ge=0, le=86400 * 366)


class SliceTopologyDiscover(Payload):
    task_id: str = Identifier
    node_id: str = Identifier
    deadline: datetime


class SliceParityCheck(Payload):
    """Run the host's parity checks now and report them (node.parity_reported with this task id); topology is
    read for the checks that need it but not reported, so it leaves the host's candidates as they are."""

    task_id: str = Identifier
    node_id: str = Identifier
    deadline: datetime


class VfioSlot(Payload):
    slot_id: str = Identifier
    gpu_pci_address: str = PciAddress
    fabric_vf_pci_address: str | None = Field(default=None, pattern=r"^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")


class SliceVfioApply(Payload):
    """The host's VFIO binding from its approved slots (runbook: persistent VFIO binding applied only once the
    host is intentionally in slice mode). `bind`: the approved slots in full, sent on entering slice mode and
    when the approved set changes there; the agent keeps them as the set parity checks. `unbind`: leaving slice
    mode; the devices of the named slots the host had bound go back to their host drivers. A device that is not a
    GPU or fabric VF of the host's own topology is refused with a reason and nothing changes."""

    task_id: str = Identifier
    node_id: str = Identifier
    deadline: datetime
    action: Literal["bind", "unbind"]
    slots: list[VfioSlot] = Field(default_factory=list, max_length=64)


class WipeSlot(Payload):
    """A slot whose disk the agent must wipe by the site's policy, named by its stable by-id identity."""

    slot_id: str = Identifier
    nvme_by_id: str = Field(min_length=1, max_length=1024)
    wipe_policy: WipePolicy


class SliceSlotWipe(Payload):
    """Wipe and verify the disks of slots no tenant holds, by the site's policy, and report each outcome
    (node.slot_wipe_reported with this task id). The scheduler sends it before a slot whose disk may hold someone
    else's data becomes available (the converting walk's re-approval, a re-approval after rediscovery, a repair
    of a cleanup_blocked slot): a proof is accepted only from that host's own report subject, never typed in. The
    agent refuses a disk a live allocation of the host leases, or one that fails its disk checks."""

    task_id: str = Identifier
    node_id: str = Identifier
    deadline: datetime
    slots: list[WipeSlot] = Field(min_length=1, max_length=64)


class SlotWipeOutcome(Payload):
    """One slot of a slice.slot_wipe: the proof of the wipe done, or why the agent did not wipe (nothing done)."""

    slot_id: str = Identifier
    device: str = Field(min_length=1, max_length=1024)
    proof: WipeProof | None = None
    reason_code: str | None = Field(default=None, max_length=64)
    reason: str | None = Field(default=None, max_length=2000)

    @model_validator(mode="after")
    def _proof_or_reason(self) -> SlotWipeOutcome:
        if (self.proof is None) == (self.reason_code is None):
            raise ValueError("an outcome carries either a proof or a reason_code")
        if self.proof is not None and self.proof.device != self.device:
            raise ValueError("the proof is of another device")
        return self


class NodeSlotWipeReported(Payload):
    """The agent's answer to a slice.slot_wipe: one outcome per slot it was asked to wipe."""

    task_id: str = Identifier
    node_id: str = Identifier
    outcomes: list[SlotWipeOutcome] = Field(min_length=1, max_length=64)


# --- slice terminal (allocator <-> node agent) ------------------------------------------------------

# Raw bytes a terminal message carries at most: base64 makes 16 KiB 21.8 KiB, well under a host's payload limit
# (identity.permissions.HOST_MAX_PAYLOAD) with the envelope around it.
TERMINAL_CHUNK_MAX = 16 * 1024
TerminalBytes = Field(default="", max_length=(TERMINAL_CHUNK_MAX + 2) // 3 * 4, pattern=r"^[A-Za-z0-9+/]*={0,2}$")
TerminalSessionEnd = Literal["client_closed", "guest_closed", "agent_gone", "ssh_failed", "deadline", "refused"]


class SliceTerminalOpen(Payload):
    """Open an SSH PTY into the allocation's guest with the host's relay key and relay it (slice terminal).
    The agent takes the guest's address, user and host key from its own record of the VM it provisioned,
    never from the task: a task cannot point the relay key at another machine."""

    task_id: str = Identifier
    session_id: uuid.UUID
    allocation_id: uuid.UUID
    node_id: str = Identifier
    deadline: datetime
    cols: int = Field(default=80, ge=10, le=1000)
    rows: int = Field(default=24, ge=5, le=1000)


class NodeTerminalOutput(Payload):
    """Bytes the guest wrote, `offset` bytes into the session's output; a request answered with
    terminal.output_ack. `eof`: the SSH session ended (`reason` says why) and nothing follows."""

    session_id: uuid.UUID
    node_id: str = Identifier
    offset: int = Field(ge=0)
    data: str = TerminalBytes
    eof: bool = False
    exit_status: int | None = None
    reason: TerminalSessionEnd | None = None
    detail: str | None = Field(default=None, max_length=512)


class TerminalOutputAck(Payload):
    """`open`: keep relaying; `closed`: the control plane ended the session, stop."""

    session_id: uuid.UUID
    status: Literal["open", "closed"]
    received: int = Field(ge=0, description="Output bytes the control plane holds so far")


class NodeTerminalInput(Payload):
    """The agent asks for the tenant's keystrokes past `received` (bytes of input it has written to the guest);
    answered with terminal.input when there are some, when the session ends, or after a short hold."""

    session_id: uuid.UUID
    node_id: str = Identifier
    received: int = Field(ge=0)


class TerminalInput(Payload):
    session_id: uuid.UUID
    status: Literal["open", "closed"]
    offset: int = Field(ge=0)
    data: str = TerminalBytes


class PciFunction(Payload):
    pci_address: str = PciAddress
    vendor_id: str = Field(pattern=r"^[0-9a-f]{4}$")
    device_id: str = Field(pattern=r"^[0-9a-f]{4}$")
    numa_node: int | None = None
    iommu_group: int | None = None
    driver: str | None = None
    pcie_switch: str | None = Field(default=None, description="Upstream port of the PCIe switch above the device")


class GpuDevice(PciFunction):
    module_id: int | None = ModuleId


class FabricManagerInfo(Payload):
    """The host's NVIDIA Fabric Manager as discovery found it. A slice host runs it in shared-NVSwitch mode
    (FABRIC_MODE=1), where it activates the NVLink partition of each multi-GPU VM; its version must equal the
    guest image's driver version."""

    mode: Literal["baremetal", "shared_nvswitch", "vgpu", "unknown"] = Field(
        description="FABRIC_MODE of fabricmanager.cfg: 0 baremetal, 1 shared_nvswitch, 2 vgpu; unknown: unreadable"
    )
    version: str | None = Field(default=None, max_length=64, description="nv-fabricmanager --version; None: absent")
    active: bool = Field(description="nvidia-fabricmanager.service is active")


class FabricDevice(PciFunction):
    role: Literal["pf", "vf"]
    physfn: str | None = Field(default=None, pattern=r"^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")
    sriov_totalvfs: int | None = Field(default=None, ge=0)
    sriov_numvfs: int | None = Field(default=None, ge=0)
    ib_device: str | None = None
    ib_port_state: str | None = None
    link_layer: str | None = None


class NvmeDevice(Payload):
    kernel_name: str = Field(
        pattern=r"^(nvme\d+n\d+|loop\d+)$",
        description="Advisory: not stable across reboots. A loop device stands for a namespace on an emulated-slot "
        "host (the lab)",
    )
    by_id: str | None = Field(default=None, description="Stable /dev/disk/by-id/nvme-eui.* or nvme-uuid.* path")
    size_bytes: int = Field(ge=0)
    numa_node: int | None = None
    mounted: bool
    mountpoints: list[str] = Field(default_factory=list)
    mounted_children: list[str] = Field(default_factory=list)
    is_os_disk: bool
    signatures: list[str] | None = Field(default=None, description="None when they could not be read")
    candidate: bool
    excluded_reason: str | None = None


class CandidateSlot(Payload):
    index: int = Field(ge=0)
    # None only on an emulated slot: a lab slot stands for a GPU it does not pretend to have.
    gpu_pci_address: str | None = Field(default=None, pattern=r"^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")
    emulated: bool = Field(
        default=False,
        description="A slot with a disk, MAC and IP but no GPU or fabric VF (a lab host under QEMU/TCG); the "
        "scheduler approves it only where its settings allow emulated slots",
    )
    numa_node: int | None = None
    pcie_switch: str | None = None
    module_id: int | None = ModuleId
    nvme_by_id: str | None = None
    fabric_claim_mode: Literal["per_slot_vf", "none"] = "per_slot_vf"
    fabric_vf_pci_address: str | None = Field(default=None, pattern=r"^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")
    mac: str = MacAddress
    private_ip: str
    ovs_bridge: str
    ovs_port: str
    complete: bool
    missing: list[str] = Field(default_factory=list)


class NodeTopologyReported(Payload):
    node_id: str = Identifier
    task_id: str | None = None
    discovered_at: datetime
    gpus: list[GpuDevice] = Field(default_factory=list)
    fabric: list[FabricDevice] = Field(default_factory=list)
    nvme: list[NvmeDevice] = Field(default_factory=list)
    candidate_slots: list[CandidateSlot] = Field(default_factory=list)
    blockers: list[str] = Field(default_factory=list)
    # Host capability evidence for runtime profiles that opt into hugepages (gpuaas_common.profiles); the
    # scheduler places those only where enough pages are configured. None: not reported (an older agent)
    # or unreadable, which placement treats as no pages.
    hugepages_1g_total: int | None = Field(
        default=None, ge=0, description="1 GiB hugepages configured on the host (sysfs nr_hugepages); 0: none"
    )
    hugepages_1g_free: int | None = Field(
        default=None, ge=0, description="1 GiB hugepages free when discovered (sysfs free_hugepages)"
    )
    # None: not reported (an older agent).
    fabric_manager: FabricManagerInfo | None = None


class ParityCheck(Payload):
    check: str = Identifier
    status: Literal["PASS", "WARN", "FAIL"]
    detail: str = Field(max_length=2048)
    remediation: str | None = Field(default=None, max_length=2048)


class NodeParityReported(Payload):
    node_id: str = Identifier
    task_id: str | None = None
    checked_at: datetime
    # `emulated`: the host serves emulated slots only (no GPU, fabric or host GPU services to check); the
    # hardware checks are reported as WARN, not applicable, and the scheduler counts such a report as passing
    # only where its settings allow emulated slots.
    profile: Literal["slice_host", "emulated"] = "slice_host"
    checks: list[ParityCheck]
    failures: int = Field(ge=0)
    warnings: int = Field(ge=0)


DriftKind = Literal[
    "domain_unmanaged",
    "domain_missing",
    "dhcp_reservation_orphaned",
    "lease_orphaned",
    "device_binding",
    "disk_unusable",
    "disk_dirty",
    # Fabric Manager and the agent disagree on an NVLink partition (active with no VM, or a VM without it).
    "nvlink_partition",
]


class NodeDrift(Payload):
    """One disagreement between the host and the agent's records. `swept`: the agent removed the orphan
    itself (evidence only). Otherwise it stands until the host agrees again or ops acknowledge it: on the
    slots named (by id, or by their GPU, fabric VF or disk among `devices`), else on the whole node."""

    kind: DriftKind
    subject: str = Field(min_length=1, max_length=1024)
    detail: str = Field(max_length=2048)
    swept: bool = False
    slot_ids: list[str] = Field(default_factory=list, max_length=64)
    devices: list[str] = Field(default_factory=list, max_length=64)


class NodeDriftReported(Payload):
    """The agent reconciler's full current drift list (empty: the host agrees with the records); each
    report replaces the previous one."""

    node_id: str = Identifier
    checked_at: datetime
    drift: list[NodeDrift] = Field(default_factory=list, max_length=1024)
    # Task messages the agent could not handle since it started: kept in its own log and counted here, never sent
    # to a dead-letter subject (hosts are off the DLQ path). Absent from older agents.
    dead_lettered: int = Field(default=0, ge=0)


# --- MAAS gateway ----------------------------------------------------------------------------------


class MaasDeployRequested(Payload):
    operation_id: str = Identifier
    allocation_id: uuid.UUID
    site: str = Identifier
    system_id: str = Identifier
    node_id: str = Identifier
    profile: str = Identifier
    # The tenant's keys, which the gateway hands to the machine in the deploy's user-data (cloud-init's
    # `ssh_authorized_keys`, for the image's default user), as MAAS passes user-data through.
    ssh_public_keys: list[str] = Field(default_factory=list, max_length=16)


class MaasReleaseRequested(Payload):
    operation_id: str = Identifier
    allocation_id: uuid.UUID
    site: str = Identifier
    system_id: str = Identifier
    node_id: str = Identifier
    # How MAAS must erase the disks; None from an older allocator, when the gateway erases `full`.
    erase_mode: EraseMode | None = None


class MaasOperationResult(Payload):
    operation_id: str = Identifier
    allocation_id: uuid.UUID
    system_id: str = Identifier
    node_id: str = Identifier
    resolution: Literal["direct", "polled"]
    maas_status_name: str | None = None
    status_message: str | None = None
    reason_code: str | None = None
    attempts: int = Field(ge=0)


class MaasDeployResult(MaasOperationResult):
    status: Literal["deployed", "failed"]
    # Where the tenant logs in, from MAAS's machine record once it is Deployed, and as whom (the site
    # profile's image's default user). Empty/None from older gateways and on failure.
    ip_addresses: list[str] = Field(default_factory=list, max_length=32)
    login_user: str | None = Field(default=None, max_length=32)


class MaasReleaseResult(MaasOperationResult):
    status: Literal["released", "failed"]
    # The erase asked of MAAS and what MAAS showed of it; None from older gateways. A release is `released` only
    # with the erase `erased`; `failed` with `failed` (reason_code disk_erase_failed) or `unconfirmed`.
    erase_mode: EraseMode | None = None
    erase_outcome: EraseOutcome | None = None


# MAAS lifecycle beyond allocations: ops commands, each resolved like a deploy and answered with a result.

MaasOsName = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._/-]*$")


class MaasScript(Payload):
    name: str = Identifier
    script: str = Field(min_length=3, max_length=1_000_000, pattern=r"^#!")
    type: Literal["commissioning", "testing"] = "commissioning"


class MaasCommissionRequested(Payload):
    operation_id: str = Identifier
    site: str = Identifier
    system_id: str = Identifier
    node_id: str | None = None
    commissioning_scripts: list[str] = Field(default_factory=list, max_length=64)
    testing_scripts: list[str] = Field(default_factory=list, max_length=64)
    # Scripts to make sure exist in MAAS (created when missing) before commissioning.
    scripts: list[MaasScript] = Field(default_factory=list, max_length=64)


class MaasTagsSyncRequested(Payload):
    operation_id: str = Identifier
    site: str = Identifier
    profile: str = Identifier
    add_system_ids: list[str] = Field(default_factory=list)
    remove_system_ids: list[str] = Field(default_factory=list)


class MaasImageUploadRequested(Payload):
    operation_id: str = Identifier
    site: str = Identifier
    name: str = MaasOsName
    title: str = ""
    architecture: str = Field(default="amd64/generic", pattern=r"^[a-z0-9]+/[a-z0-9.-]+$")
    filetype: Literal["tgz", "tbz", "txz", "ddtgz", "ddgz", "ddraw", "ddbz2", "ddxz", "ddtar"] = "tgz"
    base_image: str = "ubuntu/noble"
    source_path: str = Field(min_length=1, max_length=4096)
    sha256: str | None = Field(default=None, pattern=r"^[0-9a-f]{64}$")
    size: int | None = Field(default=None, ge=1)


class MaasProfileImageSetRequested(Payload):
    operation_id: str = Identifier
    site: str = Identifier
    profile: str = Identifier
    distro_series: str = MaasOsName


class MaasLifecycleResult(Payload):
    operation_id: str = Identifier
    site: str = Identifier
    status: Literal["succeeded", "failed"]
    resolution: Literal["direct", "polled"]
    reason_code: str | None = None
    status_message: str | None = None
    attempts: int = Field(ge=0)


class MaasCommissionResult(MaasLifecycleResult):
    system_id: str = Identifier
    node_id: str | None = None
    maas_status_name: str | None = None


class SlicePreflightCheck(Payload):
    check: str = Field(min_length=1, max_length=128)
    status: Literal["PASS", "WARN", "FAIL"]
    detail: str = Field(default="", max_length=2048)
    remediation: str = Field(default="", max_length=2048)


class SlicePreflightNvmeChild(Payload):
    name: str = Field(min_length=1, max_length=256)
    mountpoint: str = Field(default="", max_length=1024)
    fstype: str = Field(default="", max_length=64)


class SlicePreflightNvme(Payload):
    by_id: str = Field(min_length=1, max_length=1024)
    kernel: str = Field(default="", max_length=256)
    os_disk: bool = False
    mounted: bool = False
    signatures: list[str] = Field(default_factory=list, max_length=64)
    children: list[SlicePreflightNvmeChild] = Field(default_factory=list, max_length=256)


class NodeSlicePreflightReported(Payload):
    """The `GPUAAS_SLICE_*` lines of a commissioning run's firmware preflight, parsed and judged by the
    gateway. `missing`: the run has no result for the preflight script; `failed` names every reason."""

    operation_id: str = Identifier
    site: str = Identifier
    system_id: str = Identifier
    node_id: str | None = None
    result_set_id: int | None = None
    script_name: str = Field(min_length=1, max_length=256)
    script_status: str | None = None
    exit_status: int | None = None
    status: Literal["passed", "failed", "missing"]
    reasons: list[str] = Field(default_factory=list, max_length=512)
    warnings: list[str] = Field(default_factory=list, max_length=512)
    checks: list[SlicePreflightCheck] = Field(default_factory=list, max_length=512)
    nvme: list[SlicePreflightNvme] = Field(default_factory=list, max_length=256)
    reported_at: datetime


class MaasTagsSyncResult(MaasLifecycleResult):
    profile: str = Identifier
    tags: list[str] = Field(default_factory=list)
    added: int = Field(default=0, ge=0)
    removed: int = Field(default=0, ge=0)


class MaasImageUploadResult(MaasLifecycleResult):
    name: str = MaasOsName
    boot_resource_id: int | None = None
    sha256: str | None = None
    size: int | None = None


class MaasProfileImageSetResult(MaasLifecycleResult):
    profile: str = Identifier
    distro_series: str | None = None
    previous_distro_series: str | None = None
    deploy_distro_series: str | None = None


# --- image pipeline ---------------------------------------------------------------------------------


class ImageActivated(Payload):
    slug: str = Slug
    kind: Literal["slice", "host"]
    sku: str
    digest_sha256: str = Sha256
    image_path: str
    source_uri: str | None = None
    driver_strategy: DriverStrategy = "preinstalled"
    driver_version: str | None = DriverVersion


class ImageDeactivated(Payload):
    slug: str = Slug
    reason: str


class ImagePublished(Payload):
    """A build's artifact is in the registry and catalogued; node caches are being prewarmed."""

    slug: str = Slug
    build_id: str = Identifier
    digest_sha256: str = Sha256
    source_uri: str = Field(min_length=1, max_length=2048)
    image_path: str = Field(min_length=1, max_length=1024)


class ImageBuildProgress(Payload):
    """Ephemeral progress of a build (customise, convert, pack, push, catalog); safe to drop."""

    build_id: str = Identifier
    slug: str = Slug
    phase: str = Identifier
    bytes_done: int = Field(default=0, ge=0)
    bytes_total: int = Field(default=0, ge=0)
    detail: str | None = Field(default=None, max_length=2048)


class ImageNodeCacheChanged(Payload):
    """A slice host's cache state for an image changed; `schedulable` says whether the host may take
    slices on this image (its cache is verified with the catalog digest)."""

    node_id: str = Identifier
    slug: str = Slug
    status: Literal["absent", "pulling", "verified", "mismatch", "failed"]
    digest_sha256: str | None = Sha256
    schedulable: bool


class ImageCachePrewarm(Payload):
    """Make sure the node-local cache holds the image with the catalog digest: a file already there is
    hashed, and only a missing or different one is pulled from the registry artifact and verified. An
    image with no artifact (a seeded catalog row, placed on hosts by provisioning) is only checked; the
    host answers verified, mismatch or absent."""

    task_id: str = Identifier
    node_id: str = Identifier
    slug: str = Slug
    digest_sha256: str = Sha256
    image_path: str = Field(min_length=1, max_length=1024)
    artifact_ref: str | None = Field(default=None, min_length=1, max_length=2048, pattern=r"^oci://")
    blob_digest: str | None = Field(default=None, pattern=r"^sha256:[0-9a-f]{64}$")
    blob_size: int = Field(default=0, ge=0)
    blob_media_type: str | None = Field(default=None, min_length=1, max_length=255)
    virtual_size: int = Field(default=0, ge=0)
    registry_tls: Literal["verify", "insecure", "plain-http"] = "verify"

    @model_validator(mode="after")
    def _artifact_whole(self) -> ImageCachePrewarm:
        # Half an artifact cannot be pulled: name all of it or none (verify only).
        if (self.artifact_ref is None) != (self.blob_digest is None) or (self.artifact_ref is None) != (
            self.blob_media_type is None
        ):
            raise ValueError("artifact_ref, blob_digest and blob_media_type come together or not at all")
        return self


class NodeImageCacheReported(Payload):
    """A node's cache state for an image: progress while pulling, then verified, mismatch, failed (the
    transfer broke) or absent (not in the cache and no artifact to pull it from)."""

    task_id: str = Identifier
    node_id: str = Identifier
    slug: str = Slug
    status: Literal["pulling", "verified", "mismatch", "failed", "absent"]
    expected_digest: str = Sha256
    digest_sha256: str | None = Sha256
    local_path: str = Field(min_length=1, max_length=1024)
    bytes_done: int = Field(default=0, ge=0)
    bytes_total: int = Field(default=0, ge=0)
    reason: str | None = Field(default=None, max_length=2048)


# --- usage (ops-view -> billing, ops) ----------------------------------------------------------------


class UsageRecorded(Payload):
    """An allocation's usage, once it ended: from its `allocation.active` to the `allocation.released` or
    `allocation.failed` that ended it, each the event's `occurred_at` cut to the whole second (UTC). An allocation
    that never became active used nothing and has no record. One per allocation: the event id is derived from
    the allocation id, so a read model rebuilt from the streams publishes the same event again, never another."""

    allocation_id: uuid.UUID
    tenant_id: str = Identifier
    shape: Shape
    # From the allocation's `allocation.accepted`; None only when the streams no longer held it.
    sku: str | None = None
    gpu_count: int | None = Field(default=None, ge=1, le=64)
    region: str | None = None
    node_id: str | None = None
    started_at: datetime
    stopped_at: datetime
    seconds: int = Field(ge=0, description="stopped_at - started_at, in whole seconds")
    ended: AllocationEnd
    # The failure's reason code (`force_released`, `task_deadline_passed`, ...); None for a release.
    end_reason_code: str | None = Field(default=None, max_length=128)


# --- admin audit -------------------------------------------------------------------------------------


class AdminRequestRecorded(Payload):
    """One authenticated mutation of an admin API (applied, replayed or refused), published in the transaction
    that wrote its `admin_requests` row: who asked (`actor`, under the bearer token of `principal`), what
    (`method`, `path`, the answer's `status` and `error_code`), why (the body's `reason`, where it has one), which
    request (`request_id`, `idempotency_key`); when is the envelope's `occurred_at`."""

    service: str = Identifier
    request_id: str = Field(min_length=1, max_length=128)
    principal: str = Field(min_length=1, max_length=128)
    actor: str = Field(min_length=1, max_length=128)
    method: Literal["POST", "PUT", "PATCH", "DELETE"]
    path: str = Field(min_length=1, max_length=2048)
    status: int = Field(ge=100, le=599)
    error_code: str | None = Field(default=None, max_length=128)
    replayed: bool = False
    idempotency_key: str | None = Field(default=None, max_length=200)
    reason: str | None = Field(default=None, max_length=2048)
    body_sha256: str = Sha256


# One model per message type: the contract names each message by its model.
class SchedulerAdminRequestRecorded(AdminRequestRecorded):
    """The scheduler's admin API's audit record (drain, approve, quota, wipe policy, waivers, force release...)."""


class ImageAdminRequestRecorded(AdminRequestRecorded):
    """The image pipeline's admin API's audit record (builds, publishes, activations...)."""


# --- dead letters ------------------------------------------------------------------------------------


class DeadLetter(Payload):
    consumer: str
    stream: str
    subject: str
    stream_seq: int | None = None
    num_delivered: int | None = None
    # subject_mismatch: a payload names another node than the subject it came on; unknown_task: a
    # result for a task its receiver never sent; node_mismatch: a result from another host than the
    # one the task went to; unplaceable: a valid event a read model cannot fit into what it holds (a timeline
    # position already taken by another state); baremetal_tenancy: a slice-host enrolment from a node a baremetal
    # tenant holds (root on the host and its allocation-bound creds), which may never join the slice hosts.
    # binding_refused: a VFIO binding naming a device that is not a GPU or fabric VF of the host's topology (or an
    # unbind naming nothing the host had bound), nothing changed; binding_failed: driverctl failed mid-binding.
    reason_code: Literal[
        "not_json",
        "schema_invalid",
        "unknown_type",
        "max_deliver",
        "handler_error",
        "subject_mismatch",
        "unknown_task",
        "node_mismatch",
        "unplaceable",
        "baremetal_tenancy",
        "binding_refused",
        "binding_failed",
    ]
    reason: str = Field(max_length=8192)
    headers: dict[str, str] = Field(default_factory=dict)
    body_text: str | None = None
    body_base64: str | None = None
