"""The ops API's answers, as pydantic models: the OpenAPI document is rendered from them."""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any

from pydantic import BaseModel


class TimelineEntry(BaseModel):
    seq: int
    state: str
    previous_state: str | None = None
    event_id: str
    at: datetime
    detail: dict[str, Any] = {}


class Claim(BaseModel):
    allocation_id: uuid.UUID
    node_id: str
    slot_id: str
    claim_mode: str
    placed_at: datetime
    released_at: datetime | None = None
    outcome: str | None = None
    forced_by: str | None = None
    forced_reason: str | None = None


class TaskPhase(BaseModel):
    phase: str
    detail: str | None = None
    at: datetime


class NodeTask(BaseModel):
    task_id: str
    allocation_id: uuid.UUID | None = None
    node_id: str
    task_type: str | None = None
    sent_at: datetime | None = None
    deadline: datetime | None = None
    status: str
    reason_code: str | None = None
    reason: str | None = None
    finished_at: datetime | None = None
    phases: list[TaskPhase] = []


class Allocation(BaseModel):
    allocation_id: uuid.UUID
    tenant_id: str
    shape: str
    state: str
    seq: int
    sku: str | None = None
    gpu_count: int | None = None
    region: str | None = None
    image: str | None = None
    node_id: str | None = None
    claim_mode: str | None = None
    reason_code: str | None = None
    reason: str | None = None
    access: dict[str, Any] | None = None
    why_not: dict[str, Any] | None = None
    created_at: datetime
    updated_at: datetime


class AllocationPage(BaseModel):
    items: list[Allocation]
    next_cursor: str | None = None


class AllocationDetail(Allocation):
    timeline: list[TimelineEntry]
    claims: list[Claim]
    tasks: list[NodeTask]


class EvidenceAge(BaseModel):
    parity: float | None = None
    topology: float | None = None
    drift: float | None = None


class Host(BaseModel):
    node_id: str
    kind: str | None = None
    hostname: str | None = None
    agent_version: str | None = None
    maas_system_id: str | None = None
    enrolled_at: datetime | None = None
    parity_profile: str | None = None
    parity_failures: int | None = None
    parity_warnings: int | None = None
    parity_failing: list[dict[str, Any]] | None = None
    parity_checked_at: datetime | None = None
    topology_gpus: int | None = None
    topology_candidates: int | None = None
    topology_blockers: list[str] | None = None
    topology_at: datetime | None = None
    drift: list[dict[str, Any]] | None = None
    drift_checked_at: datetime | None = None
    drift_open: int = 0
    # As the scheduler announced it on the stream (scheduler.host_mode_changed); none before its first change.
    mode: str | None = None
    mode_changed_at: datetime | None = None
    # The newest announcement of the host's slots read (scheduler.slots_changed): its number and time.
    slots_generation: int | None = None
    slots_changed_at: datetime | None = None
    evidence_age_s: EvidenceAge


class HostPage(BaseModel):
    items: list[Host]
    next_cursor: str | None = None


class Slot(BaseModel):
    node_id: str
    slot_id: str
    profile: str | None = None
    gpu_pci: str | None = None
    nvme_by_id: str | None = None
    private_ip: str | None = None
    # held (a live claim), else the newer of the scheduler's announcement and the end of the slot's last claim:
    # available, disabled, retired, cleanup_blocked (domain/models.py slot_view_status).
    status: str
    held_by: uuid.UUID | None = None
    drift: list[str] = []
    # As the scheduler last announced the slot (scheduler.slots_changed); none while no announcement named it.
    announced_status: str | None = None
    status_reason: str | None = None
    health_state: str | None = None
    health_detail: str | None = None
    announced_at: datetime | None = None
    first_seen: datetime


class ModeChange(BaseModel):
    from_mode: str
    to_mode: str
    actor: str
    reason: str
    at: datetime


class HostDetail(Host):
    slots: list[Slot]
    claims: list[Claim]
    mode_history: list[ModeChange] = []
    # The host's own tasks (no allocation's), newest first: its slot wipes, each phase naming every slot's proof
    # (device, method, verified) as the host reported it.
    tasks: list[NodeTask] = []


class ImageCache(BaseModel):
    node_id: str
    status: str
    digest_sha256: str | None = None
    schedulable: bool | None = None
    updated_at: datetime


class Image(BaseModel):
    slug: str
    status: str
    kind: str | None = None
    sku: str | None = None
    digest_sha256: str | None = None
    build_id: str | None = None
    reason: str | None = None
    updated_at: datetime
    caches: dict[str, int] = {}


class ImagePage(BaseModel):
    items: list[Image]
    next_cursor: str | None = None


class ImageDetail(Image):
    caches: list[ImageCache] = []  # type: ignore[assignment]


class MaasOperation(BaseModel):
    operation_id: str
    op: str
    allocation_id: uuid.UUID | None = None
    node_id: str | None = None
    system_id: str | None = None
    status: str
    resolution: str | None = None
    reason_code: str | None = None
    status_message: str | None = None
    attempts: int | None = None
    # A release's erase: the mode asked or applied (secure, full) and what MAAS showed of it (erased, failed,
    # unconfirmed); None for other operations and until the result is read.
    erase_mode: str | None = None
    erase_outcome: str | None = None
    requested_at: datetime | None = None
    resolved_at: datetime | None = None
    updated_at: datetime


class MaasPage(BaseModel):
    items: list[MaasOperation]
    next_cursor: str | None = None


class DeadLetter(BaseModel):
    dlq_seq: int
    subject: str
    consumer: str
    stream: str
    origin_subject: str
    origin_seq: int | None = None
    reason_code: str
    reason: str
    num_delivered: int | None = None
    body_text: str | None = None
    at: datetime


class DeadLetterPage(BaseModel):
    items: list[DeadLetter]
    next_cursor: str | None = None


class StreamPosition(BaseModel):
    stream: str
    position: int
    pending: int | None = None
    delivered_seq: int | None = None
    caught_up: bool | None = None


class StreamPositions(BaseModel):
    items: list[StreamPosition]
    next_cursor: str | None = None


class UsageRecord(BaseModel):
    allocation_id: uuid.UUID
    tenant_id: str
    shape: str
    sku: str | None = None
    gpu_count: int | None = None
    region: str | None = None
    node_id: str | None = None
    started_at: datetime
    stopped_at: datetime | None = None
    ended: str | None = None
    end_reason_code: str | None = None
    start_event_id: str
    stop_event_id: str | None = None
    open: bool
    seconds: int
    gpu_seconds: int | None = None
    record_seconds: int


class UsageTotals(BaseModel):
    records: int
    open: int
    seconds: int
    gpu_seconds: int


class UsagePage(BaseModel):
    month: str
    tenant: str | None = None
    since: datetime
    until: datetime
    as_of: datetime
    totals: UsageTotals
    items: list[UsageRecord]
    next_cursor: str | None = None


class AuditRecord(BaseModel):
    event_id: str
    service: str
    request_id: str
    principal: str
    actor: str
    method: str
    path: str
    status: int
    error_code: str | None = None
    replayed: bool
    idempotency_key: str | None = None
    reason: str | None = None
    at: datetime


class AuditPage(BaseModel):
    items: list[AuditRecord]
    next_cursor: str | None = None
