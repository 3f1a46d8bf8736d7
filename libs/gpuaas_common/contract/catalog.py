"""Every message type: its payload model, its channel address, who sends it and who receives it.

This table is the single source for the AsyncAPI document, the JetStream subjects, and the
validation of messages in flight.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from pydantic import BaseModel

from . import messages as m
from .vocabulary import TaskType

# Replies travel on the asker's own inbox (`_INBOX_<identity>.…`, or `_INBOX.…` anonymously), not on a
# subject of ours: a reply spec has no address, and this is what its subject looks like.
REPLY_SUBJECT = re.compile(r"^_INBOX(_[A-Za-z0-9_-]+)?\.[A-Za-z0-9_.-]+$")


@dataclass(frozen=True)
class MessageSpec:
    """`address` None: a reply, sent to the request's reply subject. `reply`: the request is answered over
    core NATS request/reply with a message of that type; such requests are never stored in a stream."""

    type: str
    model: type[BaseModel]
    channel: str
    address: str | None
    summary: str
    producers: tuple[str, ...]
    consumers: tuple[str, ...]
    parameters: dict[str, str] = field(default_factory=dict)
    reply: str | None = None

    def subject(self, **params: str) -> str:
        if self.address is None:
            raise ValueError(f"{self.type} is a reply: it goes to the request's reply subject")
        missing = set(self.parameters) - set(params)
        if missing:
            raise ValueError(f"{self.type}: missing subject parameters {sorted(missing)}")
        subject = self.address
        for name, value in params.items():
            if not re.fullmatch(r"[A-Za-z0-9_-]+", value):
                raise ValueError(f"{self.type}: parameter {name}={value!r} is not a subject token")
            subject = subject.replace("{" + name + "}", value)
        return subject

    def subject_regex(self) -> re.Pattern[str]:
        if self.address is None:
            return REPLY_SUBJECT
        pattern = re.escape(self.address)
        for name in self.parameters:
            pattern = pattern.replace(re.escape("{" + name + "}"), r"[A-Za-z0-9_-]+")
        return re.compile(f"^{pattern}$")


NODE_ID = {"node_id": "Scheduler node id of the host whose agent sends or receives the message"}

_LIFECYCLE = {
    "accepted": (m.AllocationAccepted, "The request is valid and waits for placement."),
    "placed": (m.AllocationPlaced, "Resources are claimed on one node."),
    "unschedulable": (m.AllocationUnschedulable, "No node can take the request; reasons are counted."),
    "provisioning": (m.AllocationProvisioning, "The node agent or MAAS is building the allocation."),
    "active": (m.AllocationActive, "The allocation is ready for the tenant."),
    "releasing": (m.AllocationReleasing, "A release started."),
    "released": (m.AllocationReleased, "Resources are free again; carries the cleanup proof."),
    "failed": (m.AllocationFailed, "The allocation failed; says whether cleanup is required."),
}

# The lifecycle events the scheduler acts on: its durable filters on exactly these (gpuaas_common.jetstream), so
# the server never delivers it the others. Not `releasing`: no rule of the scheduler reads it (a slot's end is
# decided at `released` or `failed`, from what the log shows it reached: provisioning, active), so mirroring it
# was a transaction per allocation that decided nothing.
SCHEDULER_FOLLOWS = ("accepted", "provisioning", "active", "released", "failed")


# Node tasks travel on a subject per task type, `gpuaas.node.<node_id>.tasks.<type>` (the type verbatim, its dot
# included), never on one subject for all: NATS rights are per subject, so a service's right to publish is then
# exactly the task types this catalog names it the producer of (identity.permissions.produced_subjects), and a
# compromised image pipeline can send prewarms but no VM release or terminal. Per type rather than per producer:
# one type, one address, one set of producers (topology_discover has two), and the agent can tell from the
# subject alone whether a task came where its type's senders publish (NODE_TASK_PREFIX, node_task_subject).
NODE_TASK_PREFIX = "gpuaas.node.{node_id}.tasks."
NODE_TASKS_CHANNEL = "nodeTasks"


def _node_task(task: TaskType, model: type[BaseModel], summary: str, producers: tuple[str, ...]) -> MessageSpec:
    type_ = task.value  # a plain str: the spec renders into the contract
    camel = "".join(part.capitalize() for part in re.split(r"[._]", type_))
    return MessageSpec(
        type_,
        model,
        f"{NODE_TASKS_CHANNEL}{camel}",
        NODE_TASK_PREFIX + type_,
        summary,
        producers,
        ("node-agent",),
        NODE_ID,
    )


def _lifecycle_consumers(state: str) -> tuple[str, ...]:
    followers = ("scheduler",) if state in SCHEDULER_FOLLOWS else ()
    return (*followers, "portal", "ops")


ALL: tuple[MessageSpec, ...] = (
    MessageSpec(
        "allocation.requested",
        m.AllocationRequested,
        "allocationRequested",
        "gpuaas.allocation.requested",
        "A portal asks for an allocation; allocation_id is the idempotency key.",
        ("portal",),
        ("allocator",),
    ),
    MessageSpec(
        "allocation.release_requested",
        m.AllocationReleaseRequested,
        "allocationReleaseRequested",
        "gpuaas.allocation.release_requested",
        "A portal asks to release an allocation.",
        ("portal",),
        ("allocator",),
    ),
    MessageSpec(
        "allocation.rejected",
        m.AllocationRejected,
        "allocationRejected",
        "gpuaas.allocation.event.rejected",
        "A request was refused before it became an allocation.",
        ("allocator",),
        ("portal", "ops"),
    ),
    MessageSpec(
        "allocation.release_rejected",
        m.AllocationReleaseRejected,
        "allocationReleaseRejected",
        "gpuaas.allocation.event.release_rejected",
        "A release request the allocator cannot act on (unknown, already released or releasing), answered at once.",
        ("allocator",),
        ("portal", "ops"),
    ),
    MessageSpec(
        "allocation.query",
        m.AllocationQuery,
        "allocationQuery",
        # Outside every stream on purpose: a stream would store the request and answer it with a PubAck.
        "gpuaas.query.allocations",
        "Read allocations (one with its timeline, or a filtered list) from the allocator; request/reply.",
        ("portal", "ops", "scheduler"),
        ("allocator",),
        reply="allocation.query_result",
    ),
    MessageSpec(
        "allocation.query_result",
        m.AllocationQueryResult,
        "allocationQueryResult",
        None,
        "The allocator's answer to allocation.query, on the request's reply subject.",
        ("allocator",),
        ("portal", "ops", "scheduler"),
    ),
    *(
        MessageSpec(
            f"allocation.{name}",
            model,
            f"allocation{name.capitalize()}",
            f"gpuaas.allocation.event.{name}",
            summary,
            ("allocator",),
            _lifecycle_consumers(name),
        )
        for name, (model, summary) in _LIFECYCLE.items()
    ),
    MessageSpec(
        "placement.placed",
        m.PlacementPlaced,
        "placementPlaced",
        "gpuaas.scheduler.placement.placed",
        "The scheduler claimed resources for an allocation.",
        ("scheduler",),
        ("allocator",),
    ),
    MessageSpec(
        "placement.force_released",
        m.PlacementForceReleased,
        "placementForceReleased",
        "gpuaas.scheduler.placement.force_released",
        "An operator force-released an allocation's claims; its slots wait in cleanup_blocked.",
        ("scheduler",),
        ("allocator",),
    ),
    MessageSpec(
        "scheduler.host_mode_changed",
        m.HostModeChanged,
        "schedulerHostModeChanged",
        "gpuaas.scheduler.host.mode_changed",
        "A host's mode changed (slice, baremetal, converting, drained, retired): the image pipeline's activation gate "
        "stops waiting for a retired or baremetal host; ops see the host's mode history.",
        ("scheduler",),
        ("image-pipeline", "ops"),
    ),
    MessageSpec(
        "scheduler.slots_changed",
        m.SlotsChanged,
        "schedulerSlotsChanged",
        "gpuaas.scheduler.host.slots_changed",
        "A host's slots changed outside placement (approved, retired, disabled, repaired, or left cleanup_blocked by "
        "a release, a failure, a force-release or the claim audit): every slot of the host with its status and "
        "health, numbered per host so a reader keeps the newest; ops see slots never placed and their health.",
        ("scheduler",),
        ("ops",),
    ),
    MessageSpec(
        "placement.unschedulable",
        m.PlacementUnschedulable,
        "placementUnschedulable",
        "gpuaas.scheduler.placement.unschedulable",
        "The scheduler found no node, with structured reasons.",
        ("scheduler",),
        ("allocator",),
    ),
    _node_task(
        TaskType.SLICE_VM_PROVISION,
        m.SliceVmProvision,
        "Build and start a slice VM on the host.",
        ("allocator",),
    ),
    _node_task(
        TaskType.SLICE_VM_RELEASE,
        m.SliceVmRelease,
        "Stop, undefine and wipe a slice VM.",
        ("allocator",),
    ),
    MessageSpec(
        "node.task_progress",
        m.NodeTaskProgress,
        "nodeTaskProgress",
        "gpuaas.node.{node_id}.report.task_progress",
        "A node task entered a phase.",
        ("node-agent",),
        ("allocator", "ops"),
        NODE_ID,
    ),
    MessageSpec(
        "node.task_result",
        m.NodeTaskResult,
        "nodeTaskResult",
        "gpuaas.node.{node_id}.report.task_result",
        "A node task finished, with readiness evidence or wipe proof.",
        ("node-agent",),
        ("allocator",),
        NODE_ID,
    ),
    MessageSpec(
        "node.enrolled",
        m.NodeEnrolled,
        "nodeEnrolled",
        "gpuaas.node.{node_id}.report.enrolled",
        "A node agent came up and enrolled.",
        ("node-agent",),
        ("allocator", "ops"),
        NODE_ID,
    ),
    _node_task(
        TaskType.SLICE_TOPOLOGY_DISCOVER,
        m.SliceTopologyDiscover,
        "Discover the host's GPUs, fabric devices and NVMe disks and suggest slot candidates.",
        ("scheduler", "ops"),
    ),
    _node_task(
        TaskType.SLICE_PARITY_CHECK,
        m.SliceParityCheck,
        "Run the slice host parity checks now and report them.",
        ("scheduler", "ops"),
    ),
    _node_task(
        TaskType.SLICE_VFIO_APPLY,
        m.SliceVfioApply,
        "Bind the approved slots' GPUs and fabric VFs to vfio-pci (entering slice mode) or release them (leaving).",
        ("scheduler",),
    ),
    _node_task(
        TaskType.SLICE_SLOT_WIPE,
        m.SliceSlotWipe,
        "Wipe and verify the disks of slots no tenant holds by the site's policy, before they become available.",
        ("scheduler",),
    ),
    MessageSpec(
        "node.slot_wipe_reported",
        m.NodeSlotWipeReported,
        "nodeSlotWipeReported",
        "gpuaas.node.{node_id}.report.slot_wipe",
        "The agent's wipe proofs (or refusals) for a slice.slot_wipe: the only proof that frees such a slot.",
        ("node-agent",),
        ("scheduler", "ops"),
        NODE_ID,
    ),
    _node_task(
        TaskType.SLICE_TERMINAL_OPEN,
        m.SliceTerminalOpen,
        "Open an SSH PTY into a slice guest with the host's relay key and relay it to the control plane.",
        ("allocator",),
    ),
    MessageSpec(
        "node.terminal_output",
        m.NodeTerminalOutput,
        "nodeTerminalOutput",
        # Outside every stream on purpose: a tenant's terminal bytes are relayed, never stored.
        "gpuaas.node.{node_id}.terminal.output",
        "Bytes a slice guest wrote to its terminal session; request/reply.",
        ("node-agent",),
        ("allocator",),
        NODE_ID,
        reply="terminal.output_ack",
    ),
    MessageSpec(
        "terminal.output_ack",
        m.TerminalOutputAck,
        "terminalOutputAck",
        None,
        "The control plane took a terminal output chunk (or the session is closed).",
        ("allocator",),
        ("node-agent",),
    ),
    MessageSpec(
        "node.terminal_input",
        m.NodeTerminalInput,
        "nodeTerminalInput",
        "gpuaas.node.{node_id}.terminal.input",
        "The agent asks for a terminal session's keystrokes past what it has written; request/reply.",
        ("node-agent",),
        ("allocator",),
        NODE_ID,
        reply="terminal.input",
    ),
    MessageSpec(
        "terminal.input",
        m.TerminalInput,
        "terminalInput",
        None,
        "A terminal session's keystrokes for the guest (or the session is closed).",
        ("allocator",),
        ("node-agent",),
    ),
    MessageSpec(
        "node.topology_reported",
        m.NodeTopologyReported,
        "nodeTopologyReported",
        "gpuaas.node.{node_id}.report.topology",
        "Advisory host topology and candidate slots; never schedulable until approved.",
        ("node-agent",),
        ("scheduler", "ops"),
        NODE_ID,
    ),
    MessageSpec(
        "node.parity_reported",
        m.NodeParityReported,
        "nodeParityReported",
        "gpuaas.node.{node_id}.report.parity",
        "Slice host parity checks; a host is schedulable only with failures=0.",
        ("node-agent",),
        ("scheduler", "ops"),
        NODE_ID,
    ),
    MessageSpec(
        "node.drift_reported",
        m.NodeDriftReported,
        "nodeDriftReported",
        "gpuaas.node.{node_id}.report.drift",
        "The agent reconciler's current drift list (empty = clean); placement skips drifted slots until ops act.",
        ("node-agent",),
        ("scheduler", "ops"),
        NODE_ID,
    ),
    MessageSpec(
        "maas.deploy_requested",
        m.MaasDeployRequested,
        "maasDeployCommand",
        "gpuaas.maas.command.deploy",
        "Deploy a machine through MAAS: for a baremetal tenant (allocator), or a converting slice host with the "
        "slice-host site profile (scheduler; allocation_id is then the host walk's id, which no allocation has). "
        "The image pipeline follows the allocator's: a tenant's deploy opens a baremetal tenancy on the node.",
        ("allocator", "scheduler"),
        ("maas-gateway", "image-pipeline"),
    ),
    MessageSpec(
        "maas.release_requested",
        m.MaasReleaseRequested,
        "maasReleaseCommand",
        "gpuaas.maas.command.release",
        "Release a machine through MAAS.",
        ("allocator",),
        ("maas-gateway",),
    ),
    MessageSpec(
        "maas.deploy_result",
        m.MaasDeployResult,
        "maasDeployResult",
        "gpuaas.maas.result.deploy",
        "The observed outcome of a deploy.",
        ("maas-gateway",),
        # The scheduler takes the results of its host walks' deploys (by operation id) and leaves the others.
        ("allocator", "scheduler"),
    ),
    MessageSpec(
        "maas.release_result",
        m.MaasReleaseResult,
        "maasReleaseResult",
        "gpuaas.maas.result.release",
        "The observed outcome of a release.",
        ("maas-gateway",),
        # The pipeline learns from it that a failed baremetal allocation's machine was released.
        ("allocator", "image-pipeline"),
    ),
    MessageSpec(
        "maas.commission_requested",
        m.MaasCommissionRequested,
        "maasCommissionCommand",
        "gpuaas.maas.command.commission",
        "Commission a machine with named scripts.",
        ("scheduler", "ops"),
        ("maas-gateway",),
    ),
    MessageSpec(
        "maas.commission_result",
        m.MaasCommissionResult,
        "maasCommissionResult",
        "gpuaas.maas.result.commission",
        "The observed outcome of a commissioning run.",
        ("maas-gateway",),
        ("ops",),
    ),
    MessageSpec(
        "node.slice_preflight_reported",
        m.NodeSlicePreflightReported,
        "nodeSlicePreflightReported",
        "gpuaas.maas.report.slice_preflight",
        "A commissioning run's slice firmware preflight (GPUAAS_SLICE_* lines), parsed and judged.",
        ("maas-gateway",),
        ("scheduler", "ops"),
    ),
    MessageSpec(
        "maas.tags_sync_requested",
        m.MaasTagsSyncRequested,
        "maasSyncTagsCommand",
        "gpuaas.maas.command.sync_tags",
        "Create a site profile's tags and put machines in or out of them.",
        ("ops",),
        ("maas-gateway",),
    ),
    MessageSpec(
        "maas.tags_sync_result",
        m.MaasTagsSyncResult,
        "maasSyncTagsResult",
        "gpuaas.maas.result.sync_tags",
        "The tags of a profile as synced to MAAS.",
        ("maas-gateway",),
        ("ops",),
    ),
    MessageSpec(
        "maas.image_upload_requested",
        m.MaasImageUploadRequested,
        "maasUploadImageCommand",
        "gpuaas.maas.command.upload_image",
        "Upload a host image to MAAS as a custom boot resource.",
        ("image-pipeline", "ops"),
        ("maas-gateway",),
    ),
    MessageSpec(
        "maas.image_upload_result",
        m.MaasImageUploadResult,
        "maasUploadImageResult",
        "gpuaas.maas.result.upload_image",
        "The boot resource a host image was uploaded as.",
        ("maas-gateway",),
        ("image-pipeline", "ops"),
    ),
    MessageSpec(
        "maas.profile_image_set_requested",
        m.MaasProfileImageSetRequested,
        "maasSetDistroSeriesCommand",
        "gpuaas.maas.command.set_distro_series",
        "Switch the image a site profile deploys.",
        ("image-pipeline", "ops"),
        ("maas-gateway",),
    ),
    MessageSpec(
        "maas.profile_image_set_result",
        m.MaasProfileImageSetResult,
        "maasSetDistroSeriesResult",
        "gpuaas.maas.result.set_distro_series",
        "The image a site profile deploys from now on.",
        ("maas-gateway",),
        ("image-pipeline", "ops"),
    ),
    MessageSpec(
        "image.activated",
        m.ImageActivated,
        "imageActivated",
        "gpuaas.image.event.activated",
        "An image may be used for new allocations.",
        ("image-pipeline",),
        ("allocator", "ops"),
    ),
    MessageSpec(
        "image.deactivated",
        m.ImageDeactivated,
        "imageDeactivated",
        "gpuaas.image.event.deactivated",
        "An image may no longer be used for new allocations.",
        ("image-pipeline",),
        ("allocator", "ops"),
    ),
    MessageSpec(
        "image.published",
        m.ImagePublished,
        "imagePublished",
        "gpuaas.image.event.published",
        "A built image is in the registry and catalogued; not yet usable.",
        ("image-pipeline",),
        ("ops",),
    ),
    MessageSpec(
        "image.build_progress",
        m.ImageBuildProgress,
        "imageBuildProgress",
        "gpuaas.image.event.build_progress",
        "Progress of an image build and publish.",
        ("image-pipeline",),
        ("ops",),
    ),
    MessageSpec(
        "image.node_cache_changed",
        m.ImageNodeCacheChanged,
        "imageNodeCacheChanged",
        "gpuaas.image.event.node_cache_changed",
        "A slice host's verified-cache state for an image changed.",
        ("image-pipeline",),
        ("scheduler", "ops"),
    ),
    _node_task(
        TaskType.IMAGE_CACHE_PREWARM,
        m.ImageCachePrewarm,
        "Pull an image into the node-local cache and verify its digest.",
        ("image-pipeline",),
    ),
    MessageSpec(
        "node.image_cache_reported",
        m.NodeImageCacheReported,
        "nodeImageCacheReported",
        "gpuaas.node.{node_id}.report.image_cache",
        "A node's image cache state: pull progress, then verified or mismatch.",
        ("node-agent",),
        ("image-pipeline", "ops"),
        NODE_ID,
    ),
    MessageSpec(
        "usage.recorded",
        m.UsageRecorded,
        "usageRecorded",
        "gpuaas.usage.recorded",
        "An allocation's usage from active to its end, to the second; one per allocation, from the ops read models.",
        ("ops-view",),
        ("billing", "ops"),
    ),
    MessageSpec(
        "scheduler.admin_request_recorded",
        m.SchedulerAdminRequestRecorded,
        "schedulerAdminRequestRecorded",
        "gpuaas.scheduler.admin.request_recorded",
        "A mutation of the scheduler's admin API (drain, approve, quota, wipe policy, waivers, force release, ...), "
        "applied or refused: the audit record ops read.",
        ("scheduler",),
        ("ops",),
    ),
    MessageSpec(
        "image.admin_request_recorded",
        m.ImageAdminRequestRecorded,
        "imageAdminRequestRecorded",
        "gpuaas.image.event.admin_request_recorded",
        "A mutation of the image pipeline's admin API, applied or refused: the audit record ops read.",
        ("image-pipeline",),
        ("ops",),
    ),
    MessageSpec(
        "dead_letter",
        m.DeadLetter,
        "deadLetters",
        "gpuaas.dlq.{consumer}",
        "A message a consumer could not process, with the reason.",
        ("any",),
        ("ops",),
        {"consumer": "Durable consumer name that gave up on the message"},
    ),
)

BY_TYPE: dict[str, MessageSpec] = {spec.type: spec for spec in ALL}


def spec_for(type_: str) -> MessageSpec:
    try:
        return BY_TYPE[type_]
    except KeyError:
        raise KeyError(f"unknown message type {type_!r}") from None


def types_for_subject(subject: str) -> list[MessageSpec]:
    return [spec for spec in ALL if spec.subject_regex().match(subject)]


# Every node task type (a spec on a NODE_TASK_PREFIX subject): what a host's durable carries.
NODE_TASK_TYPES: tuple[str, ...] = tuple(
    spec.type for spec in ALL if spec.address is not None and spec.address.startswith(NODE_TASK_PREFIX)
)


def node_task_subject(type_: str, node_id: str) -> str:
    """The one subject a task of `type_` for `node_id` travels on; KeyError for a type that is no node task."""
    if type_ not in NODE_TASK_TYPES:
        raise KeyError(f"{type_!r} is no node task type")
    return BY_TYPE[type_].subject(node_id=node_id)
