"""What the scheduler's service layer asks of its repositories and its unit of work, as `Protocol`s: the Postgres
adapters (adapters/repository.py, adapters/hosts.py) and the tests' fakes (tests/fakes/scheduler.py) both satisfy
them, and the repository contract test holds the two to the same answers
(tests/integration/test_scheduler_repository_contract.py)."""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from datetime import datetime
from typing import Any, Protocol

from gpuaas_common.contract import messages as m
from gpuaas_common.outbox import EventCollector

from ..domain.force_release import ForceRelease, ForceReleaseSaved
from ..domain.host import Change, Host
from ..domain.host_mode import Host as HostModes


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

    async def modes(self, node_id: str) -> HostModes | None:
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


class NodeCapacity(Protocol):
    async def refresh(self, node_ids: Iterable[str]) -> None:
        """Recompute the nodes' capacity summary."""


class AdminRepositories(HostRepositories, Protocol):
    @property
    def nodes(self) -> NodeCapacity: ...

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
