"""What the allocator's service layer asks of its repositories and its unit of work, as `Protocol`s: the Postgres
adapters (adapters/repository.py, adapters/terminal_sessions.py) and the tests' fakes both satisfy them, and the
repository contract tests hold the two to the same answers (tests/integration/test_allocator_repository_contract.py).

A handler's context is `AllocatorContext[Payload]`: mypy then checks every repository call a handler makes.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from datetime import datetime
from typing import Any, Protocol, TypeAlias, TypeVar

from gpuaas_common.bus import HandlerContext
from gpuaas_common.contract import Envelope
from gpuaas_common.outbox import EventCollector

from ..domain.allocation import Allocation
from ..domain.commands import Policy
from ..domain.model import ActiveImage

Row: TypeAlias = dict[str, Any]


class Allocations(Protocol):
    """The `Allocation` aggregate, each one locked until the unit of work ends."""

    async def lock(self, allocation_id: uuid.UUID) -> Row | None:
        """The allocation's row, locked; None when there is none."""

    async def get(self, allocation_id: uuid.UUID, policy: Policy, cause: Envelope | None = None) -> Allocation | None:
        """The allocation, locked; `cause`: the message being handled."""

    def aggregate(self, row: Row, policy: Policy, cause: Envelope | None = None) -> Allocation:
        """A row this unit of work locked, as the aggregate."""

    async def save(self, alloc: Allocation) -> None:
        """What the allocation recorded: its columns and its timeline rows."""

    async def lock_machine_holders(self, node_id: str) -> list[Row]:
        """Baremetal allocations whose tenant has, or may still have, `node_id`'s machine; each locked."""

    async def accepted_seq(self, allocation_id: uuid.UUID) -> int | None:
        """The timeline seq of the allocation's `accepted` entry."""


class DueAllocations(Protocol):
    """The sweeps' rows: due ones, oldest first, at most `limit`, locked; rows another holds are skipped."""

    async def lock_overdue(self, grace_s: float, limit: int) -> list[Row]: ...

    async def lock_awaiting_maas(self, after_s: float, limit: int) -> list[Row]: ...

    async def lock_awaiting_enrolment(self, after_s: float, limit: int) -> list[Row]: ...

    async def lock_awaiting_placement(self, after_s: float, limit: int) -> list[Row]: ...


class EarlyResults(Protocol):
    """Node-task results that arrived before their allocation knew the task (redrive.py)."""

    async def keep_early_result(
        self, allocation_id: uuid.UUID, task_id: str, node_id: str, result: Any, event_id: str
    ) -> bool:
        """Keep it; False when one is already kept for the task."""

    async def take_early_result(self, allocation_id: uuid.UUID, task_id: str) -> Row | None:
        """The kept result (`node_id`, `result`), removed; None when none is kept."""


class ImageCatalog(Protocol):
    """The active images the allocator accepts requests for, and each slug's event clock."""

    async def get_image(self, slug: str) -> ActiveImage | None: ...

    async def upsert_image(self, image: ActiveImage) -> None: ...

    async def delete_image(self, slug: str) -> None: ...

    async def advance_image_clock(self, slug: str, occurred_at: datetime) -> bool:
        """Record an image event as the slug's newest; False when one as new or newer was applied already."""


class TerminalSessions(Protocol):
    """The slice terminal's audit rows (allocator.terminal_sessions), one per session."""

    async def lock_allocation(self, allocation_id: uuid.UUID) -> Row | None:
        """The allocation's `allocation_id, tenant_id, shape, state, node_id`, locked; None when there is none."""

    async def lock_tenant(self, tenant_id: str) -> None:
        """The tenant's opens, one after another until the unit of work ends."""

    async def end_stale_sessions(self, tenant_id: str, stale_after_s: float) -> int:
        """End the tenant's live sessions whose claim was not renewed for `stale_after_s`; how many."""

    async def live_counts(self, tenant_id: str, allocation_id: uuid.UUID) -> tuple[int, int]:
        """(live sessions on the allocation, live sessions of the tenant)."""

    async def insert_session(
        self,
        *,
        session_id: uuid.UUID,
        allocation_id: uuid.UUID,
        tenant_id: str,
        actor: str,
        node_id: str,
        task_id: str,
        replica_id: str,
    ) -> None: ...

    async def renew_claims(self, session_ids: list[uuid.UUID]) -> None:
        """The replica still holds these live sessions."""

    async def end_session(
        self, session_id: uuid.UUID, *, reason: str, bytes_to_guest: int, bytes_from_guest: int
    ) -> bool:
        """Complete a live session's row; False when it had already ended (or never was)."""


class AllocatorRepositories(Allocations, DueAllocations, EarlyResults, ImageCatalog, Protocol):
    """One allocator unit of work's `repos`."""

    @property
    def terminal(self) -> TerminalSessions: ...


class AllocatorUnitOfWork(Protocol):
    """A handler's or a sweep's unit of work (gpuaas_common.unit_of_work's `UnitOfWork` or `FakeUnitOfWork`)."""

    @property
    def repos(self) -> AllocatorRepositories: ...

    @property
    def events(self) -> EventCollector: ...

    async def commit(self) -> None: ...

    async def __aenter__(self) -> AllocatorUnitOfWork: ...

    async def __aexit__(self, *exc: object) -> None: ...


UnitOfWorkFactory: TypeAlias = Callable[[], AllocatorUnitOfWork]

P = TypeVar("P")
# A handler's context: its message's payload, in an allocator unit of work.
AllocatorContext: TypeAlias = HandlerContext[P, AllocatorUnitOfWork]


class AllocationReads(Protocol):
    """The reads of `allocation.query`: no lock and no unit of work, a query changes nothing."""

    async def find_allocations(
        self,
        *,
        allocation_id: uuid.UUID | None = None,
        tenant_id: str | None = None,
        state: str | None = None,
        node_id: str | None = None,
        allocation_ids: list[uuid.UUID] | None = None,
        limit: int = 100,
    ) -> list[Row]:
        """Allocations matching every filter given, newest first; at most `limit` + 1 rows."""

    async def timeline_of(self, allocation_id: uuid.UUID) -> list[Row]: ...


# Reads on one connection for the time of one answer.
ReadsFactory: TypeAlias = Callable[[], AbstractAsyncContextManager[AllocationReads]]
