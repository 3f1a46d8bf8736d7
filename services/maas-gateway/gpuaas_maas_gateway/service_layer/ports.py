"""What the gateway's service layer asks of its repositories and its units of work, as `Protocol`s: the Postgres
adapters (adapters/repository.py) satisfy them. An operation's row is a plain dict (`Row`), read by its column
names; the service layer never sees a connection, a pool or a driver's record."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import Any, Protocol, TypeAlias, TypeVar

from gpuaas_common.bus import HandlerContext
from gpuaas_common.outbox import EventCollector

# A `maas_operations` row (or the columns a statement returned of it), JSON columns as the driver gave them:
# shared.as_dict reads them either way.
Row: TypeAlias = dict[str, Any]


class OperationStore(Protocol):
    """`maas_operations`. Built with a lease owner, every write of a step is fenced on that worker's lease and
    raises LeaseLost (adapters/repository.py) when the lease is no longer its; built on the pool, each statement
    stands alone."""

    @property
    def lease_owner(self) -> str | None: ...

    async def record(
        self,
        *,
        operation_id: str,
        kind: str,
        allocation_id: Any,
        site: str,
        system_id: str | None,
        node_id: str | None,
        profile: str | None,
        params: dict[str, Any],
        deadline_at: datetime,
    ) -> bool:
        """False when the operation was already recorded (a redelivered or repeated command)."""

    async def refresh_command_seq(self, operation_id: str, seq: int) -> bool: ...

    async def claim_due(
        self, owner: str, lease_s: float, limit: int, stepping: list[str] | tuple[str, ...] = ()
    ) -> list[Row]:
        """Up to `limit` due operations leased to `owner` (`operation_id`, `site` of each)."""

    async def claim(self, operation_id: str, owner: str, lease_s: float) -> Row | None:
        """The operation leased to `owner`; None when it is closed or another worker holds it."""

    async def renew(self, operation_id: str, owner: str, lease_s: float) -> bool: ...

    async def release(self, operation_id: str, owner: str) -> None: ...

    async def get(self, operation_id: str) -> Row | None: ...

    async def lock(self, operation_id: str) -> Row | None:
        """The row, locked until the unit of work ends."""

    async def machine_busy(self, site: str, system_id: str, operation_id: str) -> bool: ...

    async def start_submit(self, operation_id: str) -> str:
        """'started', 'not_pending' or 'machine_busy'."""

    async def start_tag_sync(self, operation_id: str) -> None: ...

    async def update(self, operation_id: str, *, delay: float, **fields: Any) -> None: ...

    async def merge_progress(self, operation_id: str, progress: dict[str, Any]) -> None: ...

    async def back_to_pending(self, operation_id: str, last_status: str) -> None: ...

    async def finish(
        self,
        operation_id: str,
        outcome: str,
        *,
        status: str | None,
        message: str | None,
        result: dict[str, Any],
        reason_code: str | None = None,
    ) -> None: ...


class SiteCatalog(Protocol):
    """What ops changed at run time per site: a profile's image, the boot resources uploaded."""

    async def distro_series_override(self, site: str, profile: str | None) -> str | None: ...

    async def set_distro_series(self, site: str, profile: str, distro_series: str, operation_id: str) -> None: ...

    async def uploaded_images(self, site: str) -> set[str]: ...

    async def record_boot_resource(
        self,
        *,
        site: str,
        name: str,
        architecture: str,
        boot_resource_id: int,
        filetype: str,
        sha256: str,
        size: int,
        operation_id: str,
    ) -> None: ...


class GatewayRepositories(Protocol):
    """A gateway unit of work's `repos` (or the worker's reads on the pool)."""

    @property
    def operations(self) -> OperationStore: ...

    @property
    def catalog(self) -> SiteCatalog: ...


class GatewayUnitOfWork(Protocol):
    """One state change of an operation (gpuaas_common.unit_of_work's `UnitOfWork`)."""

    @property
    def repos(self) -> GatewayRepositories: ...

    @property
    def events(self) -> EventCollector: ...

    async def commit(self) -> None: ...

    async def __aenter__(self) -> GatewayUnitOfWork: ...

    async def __aexit__(self, *exc: object) -> None: ...


# A fresh unit of work; keyword arguments: its events' correlation and causation ids.
UnitOfWorkFactory: TypeAlias = Callable[..., GatewayUnitOfWork]

P = TypeVar("P")
# A command handler's context: its message's payload, in a gateway unit of work.
GatewayContext: TypeAlias = HandlerContext[P, GatewayUnitOfWork]


class GatewayDatabase(Protocol):
    """Where the worker's state lives: units of work whose writes are fenced on its lease, and reads (and the
    lease statements) outside any transaction, one statement each."""

    def units_of_work(self, *, lease_owner: str, lease_s: float) -> UnitOfWorkFactory: ...

    @property
    def reads(self) -> GatewayRepositories: ...
