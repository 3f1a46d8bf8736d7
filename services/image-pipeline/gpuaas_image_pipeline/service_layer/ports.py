"""What the image pipeline's service layer asks of its repositories and its unit of work, as `Protocol`s: the
Postgres adapters (adapters/repository.py) and the unit tests' fakes both satisfy them. Rows are plain dicts with
their JSON columns decoded; the service layer never sees a connection or a pool."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from datetime import datetime
from typing import Any, Protocol, TypeAlias

from gpuaas_common.outbox import EventCollector

from ..domain.catalog import SeedImage

Row: TypeAlias = dict[str, Any]


class Images(Protocol):
    """The catalog's rows (`os_images`)."""

    async def lock(self, slug: str) -> Row | None:
        """The image's row, locked until the unit of work ends; None when the catalog has no such slug."""

    async def digest(self, slug: str) -> str | None: ...

    async def prewarmable_slugs(self) -> list[str]:
        """Slice images a host should hold: published or active."""

    async def active(self) -> list[Row]: ...

    async def create(
        self, slug: str, kind: str, driver_strategy: str, compatible_sku: str, metadata: dict[str, Any]
    ) -> Row | None:
        """The new row; None when the slug is taken."""

    async def seed(self, seed: SeedImage) -> None: ...

    async def amend(
        self, slug: str, compatible_sku: str | None, driver_strategy: str | None, metadata: dict[str, Any]
    ) -> Row: ...

    async def update(self, slug: str, **fields: Any) -> None: ...

    async def activate(self, slug: str) -> int:
        """Mark the image active; its new activation seq."""

    async def delete(self, slug: str) -> None: ...


class SliceHosts(Protocol):
    """The slice hosts learnt from enrolments and what each holds in its image cache."""

    async def enrolled(self, node_id: str, hostname: str) -> None: ...

    async def node_ids(self) -> list[str]: ...

    async def forget(self, node_id: str) -> bool:
        """The host is no slice host (any longer); True when it was one."""

    async def caches_of(self, node_id: str) -> list[Row]: ...

    async def cache(self, node_id: str, slug: str) -> Row | None: ...

    async def cache_states(self, slug: str) -> dict[str, tuple[str, str | None]]:
        """Each host's cache of the image: node id → (status, digest)."""

    async def caches_of_every_host(self, slug: str) -> list[Row]:
        """One row per known slice host, its cache columns None where it holds nothing of the image."""

    async def set_cache(
        self,
        *,
        node_id: str,
        slug: str,
        status: str,
        digest: str | None,
        expected: str | None,
        local_path: str | None,
        task_id: str | None,
        done: int,
        total: int,
        reason: str | None,
    ) -> None: ...


class Tenancies(Protocol):
    """Baremetal tenancies (domain/tenancy.py): what the pipeline saw of each baremetal allocation's node."""

    async def lock_node(self, node_id: str) -> None:
        """The node's tenancies, one change after another until the unit of work ends."""

    async def record(
        self,
        allocation_id: uuid.UUID,
        node_id: str,
        *,
        deployed_at: datetime | None = None,
        machine_released: bool = False,
    ) -> Row: ...

    async def judge(self, allocation_id: uuid.UUID, *, open_: bool, state: str) -> None: ...

    async def others_deployed_before(
        self, node_id: str, allocation_id: uuid.UUID, deployed_at: datetime
    ) -> list[uuid.UUID]: ...

    async def supersede(self, allocation_id: uuid.UUID, by: uuid.UUID) -> Row: ...

    async def open_on(self, node_id: str) -> list[Row]: ...


class Builds(Protocol):
    """Build rows; a running build's writes are fenced on its lease (`fence_owner`)."""

    async def get(self, build_id: str) -> Row | None: ...

    async def any_in(self, slug: str, statuses: list[str]) -> bool: ...

    async def fail_orphaned(self, statuses: list[str], error: str) -> int:
        """Fail the builds in `statuses` whose lease ran out; how many."""

    async def insert(
        self,
        build_id: str,
        slug: str,
        status: str,
        source: str | None,
        options: dict[str, Any],
        reused_from: str | None,
        plan: dict[str, Any],
        *,
        lease_owner: str | None = None,
        lease_s: float = 0.0,
    ) -> Row: ...

    async def update(self, build_id: str, *, fence_owner: str | None = None, **fields: Any) -> bool:
        """False when `fence_owner` no longer holds the build's lease: nothing written."""


class MaasRequests(Protocol):
    """What was asked of the MAAS gateway, by its operation id."""

    async def insert(
        self, operation_id: str, slug: str, kind: str, site: str, params: dict[str, Any], profile: str | None = None
    ) -> None: ...

    async def lock(self, operation_id: str) -> Row | None: ...

    async def close(self, operation_id: str, status: str, result: dict[str, Any]) -> None: ...


class ImagePipelineRepositories(Protocol):
    """One image-pipeline unit of work's `repos`."""

    @property
    def images(self) -> Images: ...

    @property
    def hosts(self) -> SliceHosts: ...

    @property
    def builds(self) -> Builds: ...

    @property
    def maas_requests(self) -> MaasRequests: ...

    @property
    def tenancies(self) -> Tenancies: ...


class ImagePipelineUnitOfWork(Protocol):
    """A handler's, an admin request's or a build's unit of work (gpuaas_common.unit_of_work's `UnitOfWork` or
    `FakeUnitOfWork`)."""

    @property
    def repos(self) -> ImagePipelineRepositories: ...

    @property
    def events(self) -> EventCollector: ...

    async def commit(self) -> None: ...

    async def __aenter__(self) -> ImagePipelineUnitOfWork: ...

    async def __aexit__(self, *exc: object) -> None: ...


# A fresh unit of work, given the correlation id its events carry.
UnitOfWorkFactory: TypeAlias = Callable[[str | None], ImagePipelineUnitOfWork]


class BuildLeases(Protocol):
    """A running build's lease, renewed on a connection of its own (no unit of work: nothing else is written)."""

    async def renew(self, build_id: str, owner: str, lease_s: float) -> bool:
        """False when `owner` no longer holds the lease."""
