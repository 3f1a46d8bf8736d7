"""Response shapes of the scheduler's admin API: the OpenAPI document is rendered from them and the
fuzz test holds every answer to them. Rows keep columns not named here (`extra="allow"`)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict


class Row(BaseModel):
    model_config = ConfigDict(extra="allow")


class NodeView(Row):
    node_id: str
    kind: str
    hostname: str
    region: str
    pool: str
    sku: str
    mode: str
    maas_tags: list[str]
    schedulable: bool
    draining: bool
    maintenance: bool
    parity_failures: int | None
    preflight_status: str | None = None
    gpu_count: int
    free_slots: int
    total_slots: int
    updated_at: str


class NodeList(BaseModel):
    nodes: list[NodeView]


class WaiverView(Row):
    waiver_id: int
    node_id: str
    gate: str
    actor: str
    reason: str
    expires_at: str
    created_at: str
    # In force now: an expired waiver stays listed, as the record of what was approved under it.
    active: bool


class ActionView(Row):
    action_id: str
    node_id: str
    kind: str
    actor: str
    reason: str
    # requested, then succeeded | failed | expired once the host's report (or the deadline) settles it.
    status: str
    outcome: str | None
    # The reports' parts as they came in: topology, parity, preflight.
    result: dict[str, Any]
    requested_at: str
    deadline: str
    finished_at: str | None


class NodeDetail(BaseModel):
    node: NodeView
    live_claims: list[dict[str, Any]]
    mode_history: list[dict[str, Any]]
    # Waivers of the slot approval gate, newest first.
    waivers: list[WaiverView] = []
    # Rediscoveries, parity runs and commissionings asked of the node, newest first, with what each found.
    actions: list[ActionView] = []


class UndrainOut(NodeDetail):
    # Out of maintenance only: the host's wipe task (none when no slot disk owed one), the slots it moved to
    # awaiting_wipe, and every slot whose disk it asked wiped (disabled and still-awaiting ones stay as they are).
    wipe_task: str | None = None
    awaiting_wipe: list[str] = []
    wipe_asked: list[str] = []


class SteerOut(NodeDetail):
    # The ask just recorded.
    action: ActionView


class DriftItem(Row):
    drift_id: int
    node_id: str
    # None: the node as a whole.
    slot_id: str | None
    kind: str
    subject: str
    detail: str
    devices: list[str]
    status: str
    first_reported_at: str
    last_reported_at: str


class DriftList(BaseModel):
    node_id: str
    drift_open: bool
    drift_reported_at: str | None
    drift: list[DriftItem]
    acknowledged: list[int] | None = None


class ModeView(Row):
    node_id: str
    mode: str
    # Each transition out of the current mode and what still blocks it (empty = allowed now).
    transitions: dict[str, list[str]]
    history: list[dict[str, Any]]


class SlotView(Row):
    slot_id: str
    node_id: str
    gpu_pci_address: str | None
    profile: str
    status: str
    status_reason: str | None
    health_state: str
    generation: int
    storage_ownership: str
    storage_mode: str
    destructive_wipe_policy: str
    storage_identity_kind: str


class SlotList(BaseModel):
    slots: list[SlotView]


class SlotDetail(BaseModel):
    slot: SlotView
    transitions: list[dict[str, Any]]
    # The wipes asked of the slot's host (slice.slot_wipe), newest first, with what its report made of each.
    wipes: list[dict[str, Any]] = []
    # The slice.slot_wipe task a repair of a cleanup_blocked slot sent (the slot stays blocked until its proof).
    wipe_task: str | None = None


class CandidateView(Row):
    candidate_id: str
    node_id: str


class CandidateList(BaseModel):
    candidates: list[CandidateView]


class ApprovalResult(BaseModel):
    candidate_id: str
    slot_id: str
    status: str
    problems: list[str]
    # Why the slot's disk must be proven wiped by its host before it is placeable (status awaiting_wipe).
    wipe_owed: list[str] | None = None


class ApprovalOut(BaseModel):
    results: list[ApprovalResult]
    mode: str
    mode_blockers: list[str] | None = None
    # The waivers the approval went through a failing gate on (absent when the evidence passed).
    waived: list[WaiverView] | None = None
    # The slice.vfio_apply task that asks the host to bind the approved devices (absent outside slice mode).
    vfio_task: str | None = None
    # The slice.slot_wipe task asking the host to wipe the disks of slots approved awaiting_wipe.
    wipe_task: str | None = None


class QuotaRow(Row):
    tenant_id: str
    max_gpus: int


class QuotaView(BaseModel):
    tenant_id: str
    quota: QuotaRow | None
    gpus_in_use: int


class SiteWipePolicyRow(Row):
    region: str
    destructive_wipe_policy: str
    set_by: str
    reason: str
    updated_at: str


class SiteWipePolicyView(BaseModel):
    region: str
    site_policy: SiteWipePolicyRow | None
    # Only on a change: slots whose recorded policy it rewrote, and those of them a live claim holds.
    slots_updated: list[str] | None = None
    slots_in_use: list[str] | None = None


class ForceReleaseOut(BaseModel):
    allocation_id: str
    forced: bool
    holders: list[str]
    claims_released: int
    slots: dict[str, str]
    untouched: dict[str, str]
    drained_nodes: list[str]
