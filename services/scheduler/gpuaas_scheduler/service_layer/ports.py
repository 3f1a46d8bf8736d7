"""What the scheduler's service layer asks of its repositories and its unit of work, as `Protocol`s: the Postgres
adapters (adapters/repository.py, adapters/hosts.py) and the tests' fakes (tests/fakes/scheduler.py) both satisfy
them, and the repository contract test holds the two to the same answers
(tests/integration/test_scheduler_repository_contract.py)."""

from __future__ import annotations

from typing import Any, Protocol

from gpuaas_common.contract import messages as m
from gpuaas_common.outbox import EventCollector

from ..domain.host import Change, Host


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
