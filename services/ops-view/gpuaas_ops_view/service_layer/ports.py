"""What ops-view's service layer asks of its adapters, as `Protocol`s: the follower's projection of stream messages
into the read models (adapters/projection.py's `Projection`, `BatchProjection`) and the ops API's reads
(adapters/queries.py's `ReadModels`). Rows are plain dicts; the service layer never sees a connection."""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any, Protocol, TypeAlias

from pydantic import BaseModel

from ..domain.filters import AllocationFilter, Page
from ..domain.usage import Move, Usage

Row: TypeAlias = dict[str, Any]


class Projection(Protocol):
    """The read models' writes for one stream message, in the follower's transaction."""

    async def timeline_states(self, allocation_id: uuid.UUID) -> dict[int, str]:
        """The allocation's timeline so far: seq → state."""

    async def add_transition(
        self,
        allocation_id: uuid.UUID,
        seq: int,
        state: str,
        previous: str | None,
        event_id: str,
        at: datetime,
        detail: dict[str, Any],
    ) -> None: ...

    async def upsert_allocation(self, row: Row, *, newest: bool) -> None:
        """`newest`: the event is the allocation's newest so far, its state and facts replace the row's."""

    async def place_claims(
        self, allocation_id: uuid.UUID, node_id: str, mode: str, slots: list[dict[str, Any]], at: datetime
    ) -> None: ...

    async def end_claims(self, allocation_id: uuid.UUID, outcome: str, at: datetime) -> None: ...

    async def forced_release(self, allocation_id: uuid.UUID, p: dict[str, Any], at: datetime) -> None: ...

    async def moves(self, allocation_id: uuid.UUID) -> list[Move]:
        """The allocation's timeline as usage reads it (domain/usage.py)."""

    async def allocation_facts(self, allocation_id: uuid.UUID) -> Row: ...

    async def usage_closed(self, allocation_id: uuid.UUID) -> bool | None:
        """Whether the allocation's usage record is closed; None when it has none yet."""

    async def put_usage(self, allocation_id: uuid.UUID, usage: Usage, facts: Row) -> None: ...

    async def publish(
        self, type_: str, payload: BaseModel, *, aggregate_id: str, event_id: str, causation_id: str | None
    ) -> None:
        """An event through the outbox, in the same transaction."""

    async def task_status(self, task_id: str) -> str | None: ...

    async def upsert_task(self, row: Row) -> None: ...

    async def add_phase(
        self, task_id: str, node_id: str, stream_seq: int, phase: str, detail: str | None, at: datetime
    ) -> None: ...

    async def host_evidence(self, node_id: str, at: datetime, **fields: Any) -> None: ...

    async def slots_announced(self, node_id: str) -> tuple[int, str] | None:
        """The host's newest slot announcement applied: (generation, event id); None when none was."""

    async def announce_slots(
        self, node_id: str, generation: int, event_id: str, slots: list[dict[str, Any]], at: datetime
    ) -> None: ...

    async def host_mode(
        self, event_id: str, node_id: str, from_mode: str, to_mode: str, actor: str, reason: str, at: datetime
    ) -> None: ...

    async def image(self, slug: str, status: str | None, at: datetime, **fields: Any) -> None: ...

    async def image_cache(self, p: dict[str, Any], at: datetime) -> None: ...

    async def maas_status(self, operation_id: str) -> str | None: ...

    async def upsert_maas(self, row: Row) -> None: ...

    async def audit(self, event_id: str, p: dict[str, Any], at: datetime) -> None: ...

    async def dead_letter(self, dlq_seq: int, subject: str, p: dict[str, Any], at: datetime) -> None: ...


class BatchProjection(Projection, Protocol):
    """A batch's projection: what its messages read, read at once; what they write, written at the end."""

    async def load(self, allocation_ids: set[uuid.UUID], task_ids: set[str]) -> None: ...

    async def flush(self) -> None: ...


class OpsReads(Protocol):
    """The ops API's and the console's reads of the read models (no lock, no transaction: a read changes
    nothing). Lists give at most a page's `limit` + 1 rows: the one more says another page follows."""

    async def list_allocations(self, f: AllocationFilter) -> list[Row]: ...

    async def allocation(self, allocation_id: uuid.UUID) -> Row | None: ...

    async def timeline(self, allocation_id: uuid.UUID) -> list[Row]: ...

    async def claims(self, *, allocation_id: uuid.UUID | None = None, node_id: str | None = None) -> list[Row]:
        """Claims with their forced release (`forced_by`, `forced_reason`), oldest first."""

    async def tasks(self, allocation_id: uuid.UUID) -> list[Row]: ...

    async def host_tasks(self, node_id: str, limit: int = 50) -> list[Row]: ...

    async def list_hosts(self, node: str | None, kind: str | None, page: Page) -> list[Row]: ...

    async def host(self, node_id: str) -> Row | None: ...

    async def unknown_host(self, node_id: str) -> Row:
        """A host the streams named only through its claims: every column of the model, none known yet."""

    async def mode_history(self, node_id: str, limit: int = 50) -> list[Row]: ...

    async def slots(self, node_id: str) -> list[Row]: ...

    async def list_images(self) -> list[Row]: ...

    async def image(self, slug: str) -> Row | None: ...

    async def image_caches(self, slug: str) -> list[Row]: ...

    async def list_maas(
        self, status: str | None, node: str | None, since: datetime | None, until: datetime | None, page: Page
    ) -> list[Row]: ...

    async def list_dead_letters(
        self,
        consumer: str | None,
        reason_code: str | None,
        since: datetime | None,
        until: datetime | None,
        page: Page,
    ) -> list[Row]: ...

    async def list_audit(
        self,
        actor: str | None,
        service: str | None,
        request_id: str | None,
        since: datetime | None,
        until: datetime | None,
        page: Page,
    ) -> list[Row]: ...

    async def positions(self) -> dict[str, Row]:
        """Each stream's committed position: `last_seq`, `at`."""

    async def list_usage(
        self, tenant: str | None, since: datetime, until: datetime, now: datetime, page: Page
    ) -> list[Row]: ...

    async def usage_totals(self, tenant: str | None, since: datetime, until: datetime, now: datetime) -> Row: ...
