"""What the scheduler's service layer asks of its repositories and its unit of work, as `Protocol`s: the Postgres
adapters (adapters/repository.py, adapters/hosts.py) and the tests' fakes (tests/fakes/scheduler.py) both satisfy
them, and the repository contract test holds the two to the same answers
(tests/integration/test_scheduler_repository_contract.py)."""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from typing import Any, Protocol

from gpuaas_common.contract import messages as m
from gpuaas_common.outbox import EventCollector

from ..domain.drift import DriftKey
from ..domain.force_release import ForceRelease, ForceReleaseSaved
from ..domain.host import Change, Host
from ..domain.host_mode import Host as ModeHost
from ..domain.host_mode import ModeChange
from ..domain.host_walk import ApprovedSlot, HostWalk
from ..domain.steering import SteerFacts
from ..domain.vfio_binding import SlotDevices


class Hosts(Protocol):
    """The `Host` aggregate, its node locked until the unit of work ends."""

    async def get(self, node_id: str) -> Host | None:
        """The host, its node row locked FOR UPDATE and its slots with it; None when there is no such node."""

    async def save(self, host: Host) -> list[Change]:
        """Write what the host recorded, in order, and forget it; what was written."""


class SlotAnnouncements(Protocol):
    async def announcement(self, node_id: str, cause: m.SlotsChangeCause, actor: str) -> m.SlotsChanged | None:
        """The node's slots as `scheduler.slots_changed` announces them, under the node's next number."""


class Audit(Protocol):
    async def record(
        self, actor: str, action: str, target: str, reason: str | None, detail: dict[str, Any] | None = None
    ) -> None:
        """One row of the admin trail."""


class HostRepositories(Protocol):
    @property
    def hosts(self) -> Hosts: ...

    @property
    def slots(self) -> SlotAnnouncements: ...

    @property
    def audit(self) -> Audit: ...


class HostUnitOfWork(Protocol):
    """What a host's admin action needs of its unit of work: the repositories and the outbox."""

    @property
    def repos(self) -> HostRepositories: ...

    @property
    def events(self) -> EventCollector: ...


# --- evidence, steering, drift, wipes, walks (issue 39) ---------------------------------------------------------


class Evidence(Protocol):
    """The evidence no `Host` method takes: a commissioning's preflight and a node's image cache state."""

    async def node_for_machine(self, system_id: str, node_id: str | None) -> str | None:
        """The node a MAAS machine is (by its system id, else the node id named); None: no node carries it."""

    async def insert_slice_preflight(self, node_id: str | None, row: dict[str, Any]) -> bool:
        """Keep the report (`node_id` None: a machine no node carries); False when its operation's is kept already."""

    async def update_preflight(self, node_id: str, status: str, reported_at: datetime, operation_id: str) -> bool:
        """The node's preflight status, unless a newer report's is applied; whether it applied."""

    async def upsert_image_readiness(
        self, node_id: str, slug: str, status: str, digest: str | None, schedulable: bool, reported_at: datetime
    ) -> bool:
        """The image's state on the node, unless a newer one is stored; whether it applied."""


class Drift(Protocol):
    async def node_slots(self, node_id: str) -> list[dict[str, Any]]:
        """Every slot of the node with the device columns drift items are matched on (drift.SLOT_DEVICE_FIELDS)."""

    async def held_keys(self, node_id: str) -> list[DriftKey]:
        """The node's drift items not resolved, by key."""


class SlotWipes(Protocol):
    async def lock_node(self, node_id: str) -> bool:
        """The node's row lock; False: no such node."""

    async def open_asks(
        self, task_id: str, node_id: str, slots: Sequence[Mapping[str, Any]], *, cause: str, why: str, actor: str
    ) -> None:
        """One ask per slot (`slot_id`, `nvme_by_id`, `wipe_policy`), an older open ask of the slot superseded."""

    async def open_asks_of_task(self, node_id: str, task_id: str) -> list[dict[str, Any]]:
        """The task's open asks on the node, each with its slot as it is now (locked) and its effective policy."""

    async def close(self, task_id: str, slot_id: str, *, outcome: str, verdict: str, report: Mapping[str, Any]) -> None:
        """The ask answered."""

    async def lock_overdue(self, older_than_s: float, statuses: Sequence[str], limit: int) -> list[dict[str, Any]]:
        """Open asks older than that of unclaimed slots in `statuses`, locked, skipping nodes others hold."""

    async def expire(self, task_id: str, slot_ids: Sequence[str], verdict: str) -> None:
        """The asks closed `expired`."""

    async def move_slot(
        self,
        slot_id: str,
        to: str,
        reason: str | None,
        *,
        actor: str,
        only_from: Sequence[str],
        detail: dict[str, Any],
        health: tuple[str, str] | None,
    ) -> None:
        """The slot moved, only from `only_from`, and the move logged."""


class NodeAsks(Protocol):
    """The asks sent to hosts (node_actions) and the facts their rules read."""

    async def facts(self, node_id: str, kind: str) -> SteerFacts | None: ...

    async def insert(
        self, action_id: str, node_id: str, kind: str, actor: str, reason: str, deadline_s: float
    ) -> dict[str, Any] | None:
        """The ask recorded; None when one of that kind is already open for the node."""

    async def kind_of(self, action_id: str, node_id: str) -> str | None: ...

    async def record_part(
        self, action_id: str, node_id: str, part: str, value: dict[str, Any], settle: tuple[str, str] | None
    ) -> str | None:
        """One report's part added to the ask; `settle` closes it if open. Its kind, None: no such ask there."""

    async def get(self, action_id: str) -> dict[str, Any] | None: ...

    async def expire_overdue(self, outcomes: dict[str, str]) -> list[dict[str, Any]]:
        """The asks past their deadline closed, each with its kind's outcome."""

    async def due_for_parity(self, modes: tuple[str, ...], interval_s: float | None, limit: int) -> list[str]:
        """Slice hosts owed a parity run, locked, skipping nodes others hold."""


class HostModes(Protocol):
    """A host's mode aggregate (domain/host_mode.py) for a change made inside another command's transaction."""

    async def load(self, node_id: str) -> tuple[ModeHost, datetime] | None:
        """The host's mode facts and the transaction's clock; None: no such node."""

    async def save(self, host: ModeHost) -> list[ModeChange]:
        """The changes the host recorded, written with their history, and forgotten."""


class VfioSlots(Protocol):
    async def slot_devices(self, node_id: str) -> list[SlotDevices]:
        """Every slot of the node with its devices and status, which the VFIO binding is derived from."""


class WalkStore(Protocol):
    """The host walks (domain/host_walk.py), each loaded locked, and what starting or stopping one reads."""

    async def by_operation(self, operation_id: str) -> HostWalk | None: ...

    async def by_rediscovery(self, node_id: str, action_id: str) -> HostWalk | None: ...

    async def save(self, walk: HostWalk, operation_id: str | None = None) -> None:
        """The walk's state and the steps it recorded (then forgotten); inserted the first time."""

    async def owed_a_walk(self, limit: int) -> list[dict[str, Any]]:
        """Converting slice hosts owed a walk (`node_id`, `mode`, `maas_system_id`), locked, skipping held ones."""

    async def off_course(self, limit: int) -> list[tuple[HostWalk, str, str | None]]:
        """Open walks whose host left converting: each walk, the host's mode and who moved it; locked."""

    async def slots_left_behind(self, node_id: str) -> list[ApprovedSlot]:
        """The slots the host had approved when it last left slice mode."""

    async def candidates(self, node_id: str) -> list[dict[str, Any]]:
        """The host's candidate slots, as rediscovery left them."""

    async def begin_reapproval(self) -> None:
        """A savepoint the re-approval runs under."""

    async def undo_reapproval(self) -> None:
        """Back to it: nothing of a refused re-approval stays."""

    async def keep_reapproval(self) -> None: ...


class Nodes(Protocol):
    async def refresh(self, node_ids: Iterable[str]) -> None:
        """The nodes' capacity summary recomputed."""


class EvidenceRepositories(Protocol):
    """What the evidence handlers reach through `uow.repos`."""

    @property
    def hosts(self) -> Hosts: ...

    @property
    def slots(self) -> SlotAnnouncements: ...

    @property
    def nodes(self) -> Nodes: ...

    @property
    def evidence(self) -> Evidence: ...

    @property
    def drift(self) -> Drift: ...

    @property
    def wipes(self) -> SlotWipes: ...

    @property
    def asks(self) -> NodeAsks: ...

    @property
    def walks(self) -> WalkStore: ...


class EvidenceUnitOfWork(Protocol):
    @property
    def repos(self) -> EvidenceRepositories: ...

    @property
    def events(self) -> EventCollector: ...


# --- admin: nodes, quotas, drift, wipe, force release, steer (issue 39) ---
# A row as the admin API answers it: its columns by name (admin.common.jsonable turns it into JSON).
Row = dict[str, Any]


class AdminNodes(Protocol):
    """The nodes as the admin API reads and registers them."""

    async def lock(self, node_id: str) -> bool:
        """The node's row lock (inventory's protocol: the node first); False when there is no such node."""

    async def lock_mode(self, node_id: str) -> str | None:
        """The node's mode under its row lock; None for a node not registered yet."""

    async def register(self, node: Row) -> None:
        """Insert the node with its first mode, or update what it declares (never its mode): `node` holds the
        columns node_id, kind, hostname, region, pool, sku, maas_system_id, profile_intent, maas_tags, mode and
        gpu_count."""

    async def record_created(self, node_id: str, actor: str, reason: str) -> None:
        """The first row of a newly registered node's mode history."""

    async def listing(self, region: str | None, sku: str | None) -> list[Row]: ...

    async def view(self, node_id: str) -> Row | None: ...

    async def live_claims(self, node_id: str) -> list[Row]: ...

    async def mode_history(self, node_id: str) -> list[Row]:
        """Newest first."""

    async def mode_record(self, node_id: str) -> Row | None:
        """Who set the node's mode, when and why, and its last evidence reset."""

    async def modes(self, node_id: str) -> ModeHost | None:
        """The host's mode and its facts, without a lock (a read's); None: no such node."""

    async def waivers(self, node_id: str) -> list[Row]:
        """Newest first, each with whether it is in force now (`active`)."""

    async def add_waiver(self, node_id: str, gate: str, actor: str, reason: str, expires_at: datetime) -> Row: ...

    async def actions(self, node_id: str) -> list[Row]:
        """The node's asks (node_actions), newest first."""

    async def walks(self, node_id: str, limit: int) -> list[Row]:
        """The node's walks back to slice mode, newest first, each with its `steps`."""

    async def now(self) -> datetime:
        """The transaction's clock, the one a waiver's expiry is judged by."""


class Quotas(Protocol):
    async def set(self, tenant_id: str, max_gpus: int, *, actor: str, reason: str) -> None: ...

    async def get(self, tenant_id: str) -> Row | None: ...

    async def gpus_in_use(self, tenant_id: str) -> int:
        """The GPUs the tenant's live claims hold."""


class DriftLog(Protocol):
    """Host drift as ops see and acknowledge it (domain/drift.py has the rules of its reports)."""

    async def node_flags(self, node_id: str) -> Row | None:
        """The node's `drift_open` and `drift_reported_at`; None: no such node."""

    async def items(self, node_id: str, *, include_resolved: bool) -> list[Row]: ...

    async def by_id(self, node_id: str, drift_ids: list[int]) -> list[Row]: ...

    async def acknowledge(self, node_id: str, drift_ids: list[int] | None, actor: str, reason: str) -> list[Row]:
        """Open drift of the node (all, or the ids named) -> acknowledged, the node's flag and capacity
        recomputed; the rows changed."""


class WipePolicies(Protocol):
    async def site(self, region: str) -> Row | None: ...

    async def lock_region(self, region: str) -> None:
        """The region's node locks, in id order, so no release judges a proof against a changing policy."""

    async def set_site(self, region: str, policy: str, *, actor: str, reason: str) -> list[str]:
        """Set the site's policy and record it on every slot of the region; the slots whose policy changed."""

    async def claimed(self, slot_ids: list[str]) -> list[str]:
        """Those of the slots a live claim holds."""


class ForceReleases(Protocol):
    """The `ForceRelease` aggregate (domain/force_release.py)."""

    async def get(self, allocation_id: uuid.UUID) -> ForceRelease | None:
        """The allocation's live claims, read again under their nodes' locks; None when it holds none."""

    async def save(self, release: ForceRelease) -> ForceReleaseSaved:
        """Write what it recorded, in order, and end its claims if it was released."""


class AdminRepositories(HostRepositories, Protocol):
    @property
    def nodes(self) -> Nodes: ...

    @property
    def node_admin(self) -> AdminNodes: ...

    @property
    def quotas(self) -> Quotas: ...

    @property
    def drift_log(self) -> DriftLog: ...

    @property
    def wipe_policies(self) -> WipePolicies: ...

    @property
    def force_releases(self) -> ForceReleases: ...


class AdminUnitOfWork(Protocol):
    """What the inventory admin's node, quota, drift, wipe policy and force-release actions need."""

    @property
    def repos(self) -> AdminRepositories: ...

    @property
    def events(self) -> EventCollector: ...


class AskNode(Protocol):
    """An ask of a host (service_layer/steering.py's `ask`, bound to the unit of work and the steering policy):
    its row as recorded; raises steering.UnknownNode or steering.AskRefused."""

    async def __call__(self, node_id: str, kind: str, *, actor: str, reason: str) -> Row: ...
