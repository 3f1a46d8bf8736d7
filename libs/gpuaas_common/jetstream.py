"""JetStream streams and durable consumers, declared in one place and provisioned idempotently.

nats-py reuses an existing durable consumer unchanged and faststream with `declare=True` overwrites
stream configs with whatever an app collected, so services bind with `declare=False` and every
stream and consumer is created *or updated* here.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import nats.errors
import nats.js.errors
from nats.js import JetStreamContext
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    DeliverPolicy,
    DiscardPolicy,
    KeyValueConfig,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_delay, wait_fixed

from .contract.catalog import NODE_TASK_PREFIX, SCHEDULER_FOLLOWS, spec_for
from .logging import get_logger

log = get_logger(__name__)

DAY = 24 * 3600.0
# Longer than the outbox relay's retry horizon so a republish after a hiccup is still dropped.
DUPLICATE_WINDOW_S = 15 * 60.0
# How long a delivered message may go without an ack or a progress ack before JetStream redelivers it: the
# time a dead consumer holds its messages. Short, because the bus sends progress acks while it works.
ACK_WAIT_S = 5.0
# How long a publish waits for its PubAck. A PubAck takes milliseconds (p99 0.12 s on a loaded 3-server
# cluster); one that does not come was lost with the server that took the publish (a crash: nats-py fails no
# pending request when its connection drops) or waits for a Raft election. Waiting 5 s held the pipeline up to
# 5 s past an election; the message is sent again under its Nats-Msg-Id, so a late PubAck costs nothing.
PUBACK_TIMEOUT_S = 2.0


def node_tasks_filter(node_id: str) -> str:
    """Every task subject of one host (`*`: of every host): one subject per task type under the host's tasks
    (contract.catalog.NODE_TASK_PREFIX), so a durable takes them all with one filter."""
    return NODE_TASK_PREFIX.replace("{node_id}", node_id) + ">"


MIB = 1024 * 1024
GIB = 1024 * MIB
UNLIMITED = -1

# Stream bounds. JetStream reserves each stream's `max_bytes` out of the server's store (by default 75 % of the
# disk free when it starts) and refuses a stream that does not fit, so a full stream never takes another's
# space: a flood held inside NODE_REPORTS cannot make NODE_TASKS or ALLOCATIONS refuse a write. Together they
# reserve 3.75 GiB per server, so a server needs about 5 GiB of free disk.
#
# discard=new where a message must never vanish unread: a full stream refuses the publish, loudly (the outbox
# relay retries it, the portal's request fails). Sized far above normal traffic: a week of 10k allocations is
# about 100k lifecycle events and 40k tasks of 1-4 KiB, 100-200 MiB.
#
# discard=old, bounded per subject, where a newer message supersedes the older ones or where the subject is
# one sender's own: NODE_REPORTS (hosts may publish only their own report subjects, listed one by one in the
# host permissions) and DLQ. A host flooding its subjects then pushes out only its own older messages.
#
# NODE_REPORTS: 256 per subject. A host's task results in flight are at most its task durable's 16 unacked
# tasks; topology, parity, drift and image-cache reports each replace the one before, and slot-wipe reports
# answer the scheduler's rare wipe tasks. One host can so hold at most 8 subjects x 256 x 64 KiB
# (identity.permissions.HOST_MAX_PAYLOAD) = 128 MiB; 1 GiB holds that beside a hundred hosts' normal reports
# (8 x 256 x ~3 KiB each, 600 MiB). Past that the oldest go first, the ones
# consumers have long acknowledged.
REPORTS_PER_SUBJECT = 256
# DLQ: 1000 dead letters per durable await ops; a host's own DLQ subject then holds at most 64 MiB of its flood.
DEAD_LETTERS_PER_SUBJECT = 1000
# USAGE: one usage.recorded (about 1 KiB) per allocation that was active, kept 400 days so a year's billing can
# be read again from the stream; a year of 10k allocations a week is about 500 MiB. discard=new: a full stream
# refuses the publish and the record waits in ops-view's outbox.
USAGE_MAX_AGE_S = 400 * DAY


@dataclass(frozen=True)
class StreamSpec:
    name: str
    subjects: tuple[str, ...]
    max_age_s: float = 7 * DAY
    description: str = ""
    max_bytes: int = UNLIMITED
    max_msgs_per_subject: int = UNLIMITED
    discard: DiscardPolicy = DiscardPolicy.NEW

    def config(self, storage: StorageType, replicas: int = 1) -> StreamConfig:
        return StreamConfig(
            name=self.name,
            subjects=list(self.subjects),
            description=self.description,
            retention=RetentionPolicy.LIMITS,
            storage=storage,
            discard=self.discard,
            max_age=self.max_age_s,
            max_bytes=self.max_bytes,
            max_msgs_per_subject=self.max_msgs_per_subject,
            duplicate_window=DUPLICATE_WINDOW_S,
            num_replicas=replicas,
        )


STREAMS: tuple[StreamSpec, ...] = (
    StreamSpec(
        "ALLOCATIONS",
        ("gpuaas.allocation.>",),
        description="Portal input and allocation lifecycle",
        max_bytes=512 * MIB,
    ),
    StreamSpec("SCHEDULER", ("gpuaas.scheduler.>",), description="Placement results", max_bytes=256 * MIB),
    StreamSpec("NODE_TASKS", (node_tasks_filter("*"),), description="Per-host task queues", max_bytes=512 * MIB),
    StreamSpec(
        "NODE_REPORTS",
        ("gpuaas.node.*.report.>",),
        description="Task progress, results, enrolment",
        max_bytes=1 * GIB,
        max_msgs_per_subject=REPORTS_PER_SUBJECT,
        discard=DiscardPolicy.OLD,
    ),
    StreamSpec("MAAS", ("gpuaas.maas.>",), description="MAAS commands and results", max_bytes=256 * MIB),
    StreamSpec("IMAGES", ("gpuaas.image.>",), description="Image catalog events", max_bytes=256 * MIB),
    StreamSpec(
        "DLQ",
        ("gpuaas.dlq.>",),
        max_age_s=30 * DAY,
        description="Dead letters with reasons",
        max_bytes=512 * MIB,
        max_msgs_per_subject=DEAD_LETTERS_PER_SUBJECT,
        discard=DiscardPolicy.OLD,
    ),
    StreamSpec(
        "USAGE",
        ("gpuaas.usage.>",),
        max_age_s=USAGE_MAX_AGE_S,
        description="Usage records per allocation",
        max_bytes=512 * MIB,
    ),
)
STREAM_BY_NAME = {s.name: s for s in STREAMS}


def subject_matches(pattern: str, subject: str) -> bool:
    """NATS subject matching: `*` is one token, a trailing `>` one or more."""
    want, have = pattern.split("."), subject.split(".")
    for i, token in enumerate(want):
        if token == ">":
            return len(have) > i
        if i >= len(have) or (token != "*" and token != have[i]):
            return False
    return len(have) == len(want)


@functools.lru_cache(maxsize=8192)
def stream_of(subject: str) -> str:
    """The stream that captures `subject` ('' when none does): the relay's unit of publishing order."""
    for spec in STREAMS:
        if any(subject_matches(p, subject) for p in spec.subjects):
            return spec.name
    return ""


@dataclass(frozen=True)
class ConsumerSpec:
    """A durable pull consumer. One filter subject (`filter_subject`), or several (`filter_subjects`, with
    `filter_subject` empty): the subjects of only the messages its handlers act on, so the server never
    delivers the rest."""

    durable: str
    stream: str
    filter_subject: str
    max_deliver: int = 8
    ack_wait_s: float = ACK_WAIT_S
    max_ack_pending: int = 1000
    description: str = ""
    filter_subjects: tuple[str, ...] = ()

    @property
    def filters(self) -> tuple[str, ...]:
        return self.filter_subjects or (self.filter_subject,)

    @property
    def admin_provisioned(self) -> bool:
        """Created by the admin identity (`provision`), never by its service: the create subject can name one
        filter (`$JS.API.CONSUMER.CREATE.<stream>.<durable>.<filter>`), so a right to create a durable with
        several would be a right to point it at any subject of its stream. The service only binds to it."""
        return bool(self.filter_subjects)

    def config(self) -> ConsumerConfig:
        # `name` as well as `durable_name`: nats-py then creates it on
        # `$JS.API.CONSUMER.CREATE.<stream>.<name>.<filter>`, a subject that lets the server restrict
        # each identity to its own durable *and* filter.
        return ConsumerConfig(
            name=self.durable,
            durable_name=self.durable,
            description=self.description,
            deliver_policy=DeliverPolicy.ALL,
            ack_policy=AckPolicy.EXPLICIT,
            ack_wait=self.ack_wait_s,
            max_deliver=self.max_deliver,
            filter_subject=self.filter_subject or None,
            filter_subjects=list(self.filter_subjects) or None,
            max_ack_pending=self.max_ack_pending,
        )


def consumer(durable: str, stream: str, filter_subject: str | tuple[str, ...], **kw: object) -> ConsumerSpec:
    if stream not in STREAM_BY_NAME:
        raise ValueError(f"unknown stream {stream}")
    if isinstance(filter_subject, tuple):
        return ConsumerSpec(durable=durable, stream=stream, filter_subject="", filter_subjects=filter_subject, **kw)  # type: ignore[arg-type]
    return ConsumerSpec(durable=durable, stream=stream, filter_subject=filter_subject, **kw)  # type: ignore[arg-type]


# Durable consumers of the long-running services. Node agents derive theirs per host.
CONSUMERS: tuple[ConsumerSpec, ...] = (
    consumer("allocator-requested", "ALLOCATIONS", "gpuaas.allocation.requested"),
    consumer("allocator-release-requested", "ALLOCATIONS", "gpuaas.allocation.release_requested"),
    consumer("allocator-placement", "SCHEDULER", "gpuaas.scheduler.placement.>"),
    consumer("allocator-task-results", "NODE_REPORTS", "gpuaas.node.*.report.task_result"),
    consumer("allocator-enrolments", "NODE_REPORTS", "gpuaas.node.*.report.enrolled"),
    consumer("allocator-maas-results", "MAAS", "gpuaas.maas.result.>"),
    consumer("allocator-images", "IMAGES", "gpuaas.image.event.>"),
    # The lifecycle events the scheduler acts on; `placed`, `unschedulable` and the rejections are not delivered.
    consumer(
        "scheduler-allocation-events",
        "ALLOCATIONS",
        tuple(spec_for(f"allocation.{state}").subject() for state in SCHEDULER_FOLLOWS),
    ),
    consumer("maas-gateway-commands", "MAAS", "gpuaas.maas.command.>"),
    consumer("image-pipeline-enrolments", "NODE_REPORTS", "gpuaas.node.*.report.enrolled"),
    consumer("image-pipeline-cache-reports", "NODE_REPORTS", "gpuaas.node.*.report.image_cache"),
    consumer("scheduler-node-parity", "NODE_REPORTS", "gpuaas.node.*.report.parity"),
    consumer("scheduler-node-topology", "NODE_REPORTS", "gpuaas.node.*.report.topology"),
    consumer("scheduler-node-drift", "NODE_REPORTS", "gpuaas.node.*.report.drift"),
    consumer("scheduler-node-slot-wipes", "NODE_REPORTS", "gpuaas.node.*.report.slot_wipe"),
    consumer("scheduler-image-cache", "IMAGES", "gpuaas.image.event.node_cache_changed"),
    consumer("scheduler-slice-preflight", "MAAS", "gpuaas.maas.report.slice_preflight"),
    consumer("scheduler-maas-deploys", "MAAS", "gpuaas.maas.result.deploy"),
    consumer("image-pipeline-maas-uploads", "MAAS", "gpuaas.maas.result.upload_image"),
    consumer("image-pipeline-maas-profiles", "MAAS", "gpuaas.maas.result.set_distro_series"),
    # Baremetal tenancies (a tenant's host never enrols as a slice host): the deploys that hand a node to a tenant,
    # and the MAAS releases that take it back. On the MAAS stream, where every message is a machine's: following
    # the allocations' lifecycle instead read every slice allocation's events too (the subjects name no shape).
    consumer("image-pipeline-tenancies", "MAAS", "gpuaas.maas.command.deploy"),
    consumer("image-pipeline-machine-releases", "MAAS", "gpuaas.maas.result.release"),
    # A retired or baremetal host leaves the activation gate's set of slice hosts.
    consumer("image-pipeline-host-modes", "SCHEDULER", "gpuaas.scheduler.host.mode_changed"),
)
CONSUMER_BY_NAME = {c.durable: c for c in CONSUMERS}

# Streams the ops read models (services/ops-view) follow. Not durables: a read model keeps its own position in
# each stream, committed with the rows it built, and on every start creates the consumer afresh from there
# (an empty schema starts at the first message retained, which is how it rebuilds). The consumer is named, so
# the identity may create, read and delete that name only, with this filter only (identity/permissions.py).
# Portal input (allocation.requested, which carries tenants' keys) is left out: lifecycle events only.
FOLLOWERS: tuple[ConsumerSpec, ...] = (
    consumer("ops-view-allocations", "ALLOCATIONS", "gpuaas.allocation.event.>"),
    consumer("ops-view-scheduler", "SCHEDULER", "gpuaas.scheduler.>"),
    consumer("ops-view-node-tasks", "NODE_TASKS", node_tasks_filter("*")),
    consumer("ops-view-node-reports", "NODE_REPORTS", "gpuaas.node.*.report.>"),
    consumer("ops-view-images", "IMAGES", "gpuaas.image.event.>"),
    consumer("ops-view-maas", "MAAS", "gpuaas.maas.>"),
    consumer("ops-view-dlq", "DLQ", "gpuaas.dlq.>"),
)


def node_agent_consumer(node_id: str, max_deliver: int = 8, ack_wait_s: float = ACK_WAIT_S) -> ConsumerSpec:
    return consumer(
        f"node-agent-{node_id}",
        "NODE_TASKS",
        node_tasks_filter(node_id),
        max_deliver=max_deliver,
        ack_wait_s=ack_wait_s,
        max_ack_pending=16,
    )


def _stream_differs(have: StreamConfig, want: StreamConfig) -> bool:
    return (
        sorted(have.subjects or []) != sorted(want.subjects or [])
        or have.max_age != want.max_age
        or (have.max_bytes or UNLIMITED) != (want.max_bytes or UNLIMITED)
        or (have.max_msgs_per_subject or UNLIMITED) != (want.max_msgs_per_subject or UNLIMITED)
        or (have.discard or DiscardPolicy.OLD) != (want.discard or DiscardPolicy.OLD)
        or have.duplicate_window != want.duplicate_window
        or have.description != want.description
        or (have.num_replicas or 1) != (want.num_replicas or 1)
    )


def _consumer_differs(have: ConsumerConfig, want: ConsumerConfig) -> bool:
    return (
        have.max_deliver != want.max_deliver
        or have.ack_wait != want.ack_wait
        or (have.filter_subject or None) != (want.filter_subject or None)
        or sorted(have.filter_subjects or []) != sorted(want.filter_subjects or [])
        or have.max_ack_pending != want.max_ack_pending
        or have.ack_policy != want.ack_policy
    )


async def ensure_stream(
    js: JetStreamContext, spec: StreamSpec, storage: StorageType = StorageType.FILE, replicas: int = 1
) -> str:
    want = spec.config(storage, replicas)
    try:
        info = await js.stream_info(spec.name)
    except nats.js.errors.NotFoundError:
        try:
            await js.add_stream(want)
            log.info("stream_created", stream=spec.name)
            return "created"
        except nats.js.errors.BadRequestError:
            # Another service won the race to create it; fall through to the comparison.
            info = await js.stream_info(spec.name)
    if _stream_differs(info.config, want):
        await js.update_stream(want)
        log.info("stream_updated", stream=spec.name)
        return "updated"
    return "unchanged"


class DurableNotAsProvisioned(Exception):
    """A durable only the admin identity creates (`ConsumerSpec.admin_provisioned`) exists with another config
    than this code's: provisioning has not been run for this version."""


async def ensure_consumer(js: JetStreamContext, spec: ConsumerSpec, *, create: bool = True) -> str:
    """Create or update the durable; `create=False` (a service binding to a durable the admin provisions) only
    checks it is there as declared: NotFoundError while it is not, DurableNotAsProvisioned when it differs."""
    want = spec.config()
    try:
        info = await js.consumer_info(spec.stream, spec.durable)
    except nats.js.errors.NotFoundError:
        if not create:
            raise
        await js.add_consumer(spec.stream, want)
        log.info("consumer_created", consumer=spec.durable, stream=spec.stream)
        return "created"
    if not create:
        if _consumer_differs(info.config, want):
            raise DurableNotAsProvisioned(
                f"{spec.durable} on {spec.stream} filters {info.config.filter_subjects or info.config.filter_subject}"
                f" (max_deliver {info.config.max_deliver}, ack_wait {info.config.ack_wait}), not {list(spec.filters)}"
                f" (max_deliver {spec.max_deliver}, ack_wait {spec.ack_wait_s}): run the admin's provisioning"
                " (`gpuaas identities provision`) for this version"
            )
        return "bound"
    if _consumer_differs(info.config, want):
        # add_consumer on an existing durable is the JetStream "create or update" call.
        await js.add_consumer(spec.stream, want)
        log.info("consumer_updated", consumer=spec.durable, stream=spec.stream)
        return "updated"
    return "unchanged"


# A deployment's retry limits for the durables (GPUAAS_CONSUMER_MAX_DELIVER, GPUAAS_CONSUMER_ACK_WAIT_S: the
# services' defaults): provisioning creates each durable with them, and a service binds only to a durable so made.
DEPLOYED_MAX_DELIVER = 8
DEPLOYED_ACK_WAIT_S = ACK_WAIT_S


def deployed(
    spec: ConsumerSpec, max_deliver: int = DEPLOYED_MAX_DELIVER, ack_wait_s: float = DEPLOYED_ACK_WAIT_S
) -> ConsumerSpec:
    """A declared durable with the deployment's retry limits (not one with several filters: the admin has always
    made those as declared); a consumer may declare a longer ack wait, none shorter."""
    if spec.admin_provisioned:
        return spec
    return replace(spec, max_deliver=max_deliver, ack_wait_s=max(spec.ack_wait_s, ack_wait_s))


async def ensure_consumers(
    js: JetStreamContext,
    consumers: tuple[ConsumerSpec, ...] | list[ConsumerSpec],
    *,
    create: bool = True,
    wait_s: float = 60.0,
) -> dict[str, str]:
    """Bind to one's durables, waiting for them to be provisioned by the admin identity: on a bus with identities
    (`create=False`) no service may create or change a durable, whose every field (ack wait, deliveries, deliver
    policy) is then the admin's. `create=True` (an open dev bus): create or update the ones of a single filter."""
    outcome: dict[str, str] = {}
    for spec in consumers:
        async for attempt in AsyncRetrying(
            # Not provisioned yet, or (in a cluster) the API timed out or had no leader for a moment: both
            # pass; a replica that gave up here would exit at start.
            retry=retry_if_exception_type(
                (nats.js.errors.NotFoundError, nats.errors.TimeoutError, nats.js.errors.ServiceUnavailableError)
            ),
            wait=wait_fixed(0.5),
            stop=stop_after_delay(wait_s),
            reraise=True,
            before_sleep=lambda _s, spec=spec: log.info(
                "stream_not_provisioned_yet", stream=spec.stream, consumer=spec.durable
            ),
        ):
            with attempt:
                made = await ensure_consumer(js, spec, create=create and not spec.admin_provisioned)
                outcome[f"consumer:{spec.durable}"] = made
    return outcome


# The bus's revocation ledger (see identity/authority.py): one key, compare-and-set, no history needed.
IDENTITY_BUCKET = "IDENTITY"


async def ensure_identity_bucket(
    js: JetStreamContext, storage: StorageType = StorageType.FILE, replicas: int = 1
) -> str:
    try:
        await js.key_value(IDENTITY_BUCKET)
        return "unchanged"
    except nats.js.errors.BucketNotFoundError:
        # No direct get: its responders come up after the stream and answered "no responders" under load;
        # reads go through the JetStream API, which always answers.
        await js.create_key_value(
            KeyValueConfig(bucket=IDENTITY_BUCKET, history=1, storage=storage, direct=False, replicas=replicas)
        )
        log.info("kv_created", bucket=IDENTITY_BUCKET)
        return "created"


async def provision(
    js: JetStreamContext,
    consumers: tuple[ConsumerSpec, ...] | list[ConsumerSpec] = (),
    storage: StorageType = StorageType.FILE,
    replicas: int = 1,
    *,
    wait_s: float = 30.0,
) -> dict[str, str]:
    """Every stream, every service's durable (with the deployment's retry limits, `deployed`) and the given
    durables: what the admin identity does, the only identity that may; services bind (ensure_consumers).

    `replicas` is 3 on a 3-node cluster (every stream, the ledger and — by inheritance — every durable
    survive one dead server), 1 on a single server."""
    outcome: dict[str, str] = {}
    async for attempt in AsyncRetrying(
        # A cluster whose servers all pass /healthz can still answer "JetStream not enabled for account"
        # (503) for a moment after the first meta leader election, or time out while a stream elects its
        # leader: a one-shot provisioning step that gave up there would keep every service from starting.
        # Each call is idempotent, so the whole pass is simply run again.
        retry=retry_if_exception_type((nats.errors.TimeoutError, nats.js.errors.ServiceUnavailableError)),
        wait=wait_fixed(0.5),
        stop=stop_after_delay(wait_s),
        reraise=True,
        before_sleep=lambda state: log.info("jetstream_not_ready_yet", error=str(state.outcome.exception())),
    ):
        with attempt:
            for stream in STREAMS:
                outcome[f"stream:{stream.name}"] = await ensure_stream(js, stream, storage, replicas)
            outcome[f"kv:{IDENTITY_BUCKET}"] = await ensure_identity_bucket(js, storage, replicas)
    durables = {c.durable: deployed(c) for c in CONSUMERS}
    durables.update((c.durable, c) for c in consumers)
    for spec in durables.values():
        outcome[f"consumer:{spec.durable}"] = await ensure_consumer(js, spec)
    return outcome
