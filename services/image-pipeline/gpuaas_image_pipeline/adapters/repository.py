"""Postgres access for the image catalog, node caches, builds and MAAS requests.

Rows come back as dicts with their JSON columns decoded, and JSON columns are written from Python
values, so the service layer never sees SQL or wire encodings (and unit tests can fake these classes).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import asyncpg

from gpuaas_common.unit_of_work import UnitOfWork

from ..domain.catalog import SeedImage

JSON_COLUMNS = ("metadata", "options", "plan", "params", "result")


def _row(record: asyncpg.Record | None) -> dict[str, Any] | None:
    if record is None:
        return None
    out = dict(record)
    for key in JSON_COLUMNS:
        if isinstance(out.get(key), str):
            out[key] = json.loads(out[key])
    return out


def _rows(records: list[asyncpg.Record]) -> list[dict[str, Any]]:
    return [_row(r) for r in records]  # type: ignore[misc]


def _values(fields: dict[str, Any]) -> list[Any]:
    return [json.dumps(v) if k in JSON_COLUMNS and v is not None else v for k, v in fields.items()]


class ImageRepository:
    """The catalog rows (`os_images`)."""

    def __init__(self, conn: asyncpg.Connection) -> None:
        self.conn = conn

    async def lock(self, slug: str) -> dict[str, Any] | None:
        """The image, locked until the unit of work ends: changes to one image serialise here."""
        return _row(await self.conn.fetchrow("SELECT * FROM os_images WHERE slug = $1 FOR UPDATE", slug))

    async def get(self, slug: str) -> dict[str, Any] | None:
        return _row(await self.conn.fetchrow("SELECT * FROM os_images WHERE slug = $1", slug))

    async def all_by_slug(self) -> list[dict[str, Any]]:
        return _rows(await self.conn.fetch("SELECT * FROM os_images ORDER BY slug"))

    async def kind(self, slug: str) -> str | None:
        return await self.conn.fetchval("SELECT kind FROM os_images WHERE slug = $1", slug)

    async def digest(self, slug: str) -> str | None:
        return await self.conn.fetchval("SELECT digest_sha256 FROM os_images WHERE slug = $1", slug)

    async def prewarmable_slugs(self) -> list[str]:
        """Slice images a newly enrolled host should hold: published (being gated) or active."""
        rows = await self.conn.fetch(
            "SELECT slug FROM os_images WHERE kind = 'slice' AND status IN ('published', 'active') ORDER BY slug"
        )
        return [r["slug"] for r in rows]

    async def active(self) -> list[dict[str, Any]]:
        return _rows(await self.conn.fetch("SELECT * FROM os_images WHERE status = 'active' ORDER BY slug"))

    async def create(
        self, slug: str, kind: str, driver_strategy: str, compatible_sku: str, metadata: dict[str, Any]
    ) -> dict[str, Any] | None:
        """A new disabled row; None when the slug is taken."""
        return _row(
            await self.conn.fetchrow(
                "INSERT INTO os_images (slug, kind, status, driver_strategy, compatible_sku, metadata) "
                "VALUES ($1, $2, 'disabled', $3, $4, $5) ON CONFLICT (slug) DO NOTHING RETURNING *",
                slug,
                kind,
                driver_strategy,
                compatible_sku,
                json.dumps(metadata),
            )
        )

    async def seed(self, seed: SeedImage) -> None:
        # ON CONFLICT DO NOTHING: an existing row keeps its digest and status, whatever the seed says. A slice
        # image starts published: active only once the activation gate saw every slice host verify it.
        await self.conn.execute(
            "INSERT INTO os_images (slug, kind, status, driver_strategy, compatible_sku, source_uri, digest_sha256, "
            "metadata) VALUES ($1, $2, $8, $3, $4, $5, $6, $7) ON CONFLICT (slug) DO NOTHING",
            seed.slug,
            seed.kind,
            seed.driver_strategy,
            seed.sku,
            seed.source_uri,
            seed.digest_sha256,
            json.dumps({"image_path": seed.image_path}),
            "published" if seed.kind == "slice" else "active",
        )

    async def amend(
        self, slug: str, compatible_sku: str | None, driver_strategy: str | None, metadata: dict[str, Any]
    ) -> dict[str, Any]:
        """An operator's change: SKU and strategy only where given."""
        row = await self.conn.fetchrow(
            "UPDATE os_images SET compatible_sku = COALESCE($2, compatible_sku), "
            "driver_strategy = COALESCE($3, driver_strategy), metadata = $4, updated_at = now() "
            "WHERE slug = $1 RETURNING *",
            slug,
            compatible_sku,
            driver_strategy,
            json.dumps(metadata),
        )
        return _row(row)  # type: ignore[return-value]

    async def update(self, slug: str, **fields: Any) -> None:
        sets = ", ".join(f"{col} = ${i}" for i, col in enumerate(fields, start=2))
        await self.conn.execute(
            f"UPDATE os_images SET {sets}, updated_at = now() WHERE slug = $1", slug, *_values(fields)
        )

    async def activate(self, slug: str) -> int:
        """Mark it active; the new activation sequence number keeps each activation's event id distinct."""
        return await self.conn.fetchval(
            "UPDATE os_images SET status = 'active', activation_seq = activation_seq + 1, updated_at = now() "
            "WHERE slug = $1 RETURNING activation_seq",
            slug,
        )

    async def delete(self, slug: str) -> None:
        await self.conn.execute("DELETE FROM os_images WHERE slug = $1", slug)


class SliceHostRepository:
    """The slice hosts learnt from enrolments and what each holds in its image cache."""

    def __init__(self, conn: asyncpg.Connection) -> None:
        self.conn = conn

    async def enrolled(self, node_id: str, hostname: str) -> None:
        await self.conn.execute(
            "INSERT INTO slice_hosts (node_id, hostname) VALUES ($1, $2) ON CONFLICT (node_id) DO UPDATE "
            "SET hostname = EXCLUDED.hostname, last_enrolled_at = now()",
            node_id,
            hostname,
        )

    async def node_ids(self) -> list[str]:
        return [r["node_id"] for r in await self.conn.fetch("SELECT node_id FROM slice_hosts ORDER BY node_id")]

    async def forget(self, node_id: str) -> bool:
        """The node is no slice host any more (a baremetal tenant holds it); False when it was none."""
        return (await self.conn.execute("DELETE FROM slice_hosts WHERE node_id = $1", node_id)) != "DELETE 0"

    async def caches_of(self, node_id: str) -> list[dict[str, Any]]:
        """What one host holds of every image, as last reported (absent ones included)."""
        return _rows(
            await self.conn.fetch(
                "SELECT slug, status, digest_sha256, expected_digest, task_id FROM node_image_cache "
                "WHERE node_id = $1 ORDER BY slug",
                node_id,
            )
        )

    async def cache(self, node_id: str, slug: str) -> dict[str, Any] | None:
        return _row(
            await self.conn.fetchrow(
                "SELECT status, digest_sha256, task_id FROM node_image_cache WHERE node_id = $1 AND slug = $2",
                node_id,
                slug,
            )
        )

    async def cache_states(self, slug: str) -> dict[str, tuple[str, str | None]]:
        """Each host's (status, digest) for one image; hosts without a cache row are absent."""
        rows = await self.conn.fetch(
            "SELECT node_id, status, digest_sha256 FROM node_image_cache WHERE slug = $1", slug
        )
        return {r["node_id"]: (r["status"], r["digest_sha256"]) for r in rows}

    async def caches_of_every_host(self, slug: str) -> list[dict[str, Any]]:
        """One row per known slice host, its cache columns NULL where it holds nothing of the image."""
        return _rows(
            await self.conn.fetch(
                "SELECT h.node_id, h.hostname, c.status, c.digest_sha256, c.expected_digest, c.local_path, "
                "c.verified_at, c.bytes_done, c.bytes_total, c.reason, c.updated_at FROM slice_hosts h "
                "LEFT JOIN node_image_cache c ON c.node_id = h.node_id AND c.slug = $1 ORDER BY h.node_id",
                slug,
            )
        )

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
    ) -> None:
        """Upsert; a report without a path or task id keeps the ones already known."""
        await self.conn.execute(
            "INSERT INTO node_image_cache (node_id, slug, status, digest_sha256, local_path, verified_at, "
            "expected_digest, task_id, bytes_done, bytes_total, reason, updated_at) "
            "VALUES ($1, $2, $3, $4, $5, CASE WHEN $3 = 'verified' THEN now() END, $6, $7, $8, $9, $10, now()) "
            "ON CONFLICT (node_id, slug) DO UPDATE SET status = EXCLUDED.status, "
            "digest_sha256 = EXCLUDED.digest_sha256, "
            "local_path = COALESCE(EXCLUDED.local_path, node_image_cache.local_path), "
            "verified_at = CASE WHEN EXCLUDED.status = 'verified' THEN now() ELSE NULL END, "
            "expected_digest = EXCLUDED.expected_digest, "
            "task_id = COALESCE(EXCLUDED.task_id, node_image_cache.task_id), "
            "bytes_done = EXCLUDED.bytes_done, bytes_total = EXCLUDED.bytes_total, reason = EXCLUDED.reason, "
            "updated_at = now()",
            node_id,
            slug,
            status,
            digest,
            local_path,
            expected,
            task_id,
            done,
            total,
            reason,
        )


class TenancyRepository:
    """Baremetal tenancies (domain/tenancy.py): what the pipeline saw of each baremetal allocation's node."""

    def __init__(self, conn: asyncpg.Connection) -> None:
        self.conn = conn

    async def lock_node(self, node_id: str) -> None:
        """Until the unit of work ends: a node's enrolments and its tenancies' changes run one at a time, so an
        enrolment never slips in beside the placement that makes the node a tenant's."""
        await self.conn.execute("SELECT pg_advisory_xact_lock(hashtext('gpuaas-pipeline-node:' || $1))", node_id)

    async def record(
        self,
        allocation_id: uuid.UUID,
        node_id: str,
        *,
        deployed_at: datetime | None = None,
        machine_released: bool = False,
    ) -> dict[str, Any]:
        """Add facts (each only ever set, never cleared): `deployed_at` the deploy went out then; the row as it
        is now."""
        row = await self.conn.fetchrow(
            "INSERT INTO baremetal_tenancies (allocation_id, node_id, deployed_at, deployed, machine_released) "
            "VALUES ($1, $2, $3::timestamptz, $3::timestamptz IS NOT NULL, $4) "
            "ON CONFLICT (allocation_id) DO UPDATE SET "
            "deployed_at = COALESCE(baremetal_tenancies.deployed_at, EXCLUDED.deployed_at), "
            "deployed = baremetal_tenancies.deployed OR EXCLUDED.deployed, "
            "machine_released = baremetal_tenancies.machine_released OR EXCLUDED.machine_released, "
            "updated_at = now() RETURNING *",
            allocation_id,
            node_id,
            deployed_at,
            machine_released,
        )
        return _row(row)  # type: ignore[return-value]

    async def judge(self, allocation_id: uuid.UUID, *, open_: bool, state: str) -> None:
        """Store the judgement of the row's facts; `ended_at` marks when an open tenancy was judged over."""
        await self.conn.execute(
            "UPDATE baremetal_tenancies SET open = $2, state = $3, updated_at = now(), "
            "ended_at = CASE WHEN $2 THEN NULL WHEN open THEN now() ELSE ended_at END WHERE allocation_id = $1",
            allocation_id,
            open_,
            state,
        )

    async def others_deployed_before(
        self, node_id: str, allocation_id: uuid.UUID, deployed_at: datetime
    ) -> list[uuid.UUID]:
        """Other allocations' tenancies on the node, not superseded yet, deployed before `deployed_at`."""
        rows = await self.conn.fetch(
            "SELECT allocation_id FROM baremetal_tenancies WHERE node_id = $1 AND allocation_id <> $2 "
            "AND superseded_by IS NULL AND deployed_at < $3 ORDER BY allocation_id",
            node_id,
            allocation_id,
            deployed_at,
        )
        return [r["allocation_id"] for r in rows]

    async def supersede(self, allocation_id: uuid.UUID, by: uuid.UUID) -> dict[str, Any]:
        row = await self.conn.fetchrow(
            "UPDATE baremetal_tenancies SET superseded_by = $2, updated_at = now() WHERE allocation_id = $1 "
            "RETURNING *",
            allocation_id,
            by,
        )
        return _row(row)  # type: ignore[return-value]

    async def open_on(self, node_id: str) -> list[dict[str, Any]]:
        """The node's open tenancies (normally one)."""
        return _rows(
            await self.conn.fetch(
                "SELECT * FROM baremetal_tenancies WHERE node_id = $1 AND open ORDER BY deployed_at, allocation_id",
                node_id,
            )
        )


class BuildRepository:
    def __init__(self, conn: asyncpg.Connection) -> None:
        self.conn = conn

    async def get(self, build_id: str) -> dict[str, Any] | None:
        return _row(await self.conn.fetchrow("SELECT * FROM builds WHERE build_id = $1", build_id))

    async def of_image(self, slug: str, limit: int) -> list[dict[str, Any]]:
        """Newest first."""
        return _rows(
            await self.conn.fetch("SELECT * FROM builds WHERE slug = $1 ORDER BY created_at DESC LIMIT $2", slug, limit)
        )

    async def any_in(self, slug: str, statuses: list[str]) -> bool:
        return bool(
            await self.conn.fetchval(
                "SELECT 1 FROM builds WHERE slug = $1 AND status = ANY($2::text[])", slug, statuses
            )
        )

    async def fail_orphaned(self, statuses: list[str], error: str) -> int:
        """Fail the builds in `statuses` whose lease has run out (their process is gone). SKIP LOCKED: a
        replica sweeping at the same time takes other rows, never waits on ours."""
        res = await self.conn.execute(
            "UPDATE builds SET status = 'failed', error = $2, lease_owner = NULL, lease_until = NULL, "
            "updated_at = now() WHERE build_id IN (SELECT build_id FROM builds WHERE status = ANY($1::text[]) "
            "AND (lease_until IS NULL OR lease_until < now()) FOR UPDATE SKIP LOCKED)",
            statuses,
            error,
        )
        return int(res.split()[-1])

    async def renew(self, build_id: str, owner: str, lease_s: float) -> bool:
        return bool(
            await self.conn.fetchval(
                "UPDATE builds SET lease_until = now() + make_interval(secs => $3) "
                "WHERE build_id = $1 AND lease_owner = $2 RETURNING 1",
                build_id,
                owner,
                float(lease_s),
            )
        )

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
    ) -> dict[str, Any]:
        row = await self.conn.fetchrow(
            "INSERT INTO builds (build_id, slug, status, source, options, reused_from, plan, lease_owner, "
            "lease_until) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, "
            "CASE WHEN $8::text IS NULL THEN NULL ELSE now() + make_interval(secs => $9) END) RETURNING *",
            build_id,
            slug,
            status,
            source,
            json.dumps(options),
            reused_from,
            json.dumps(plan),
            lease_owner,
            float(lease_s),
        )
        return _row(row)  # type: ignore[return-value]

    async def update(self, build_id: str, *, fence_owner: str | None = None, **fields: Any) -> bool:
        """False when `fence_owner` is given and no longer holds the build's lease (nothing is changed)."""
        sets = ", ".join(f"{col} = ${i}" for i, col in enumerate(fields, start=2))
        fence = f" AND lease_owner = ${len(fields) + 2}" if fence_owner is not None else ""
        res = await self.conn.execute(
            f"UPDATE builds SET {sets}, updated_at = now() WHERE build_id = $1{fence}",
            build_id,
            *_values(fields),
            *((fence_owner,) if fence_owner is not None else ()),
        )
        return int(res.split()[-1]) > 0


class MaasRequestRepository:
    """What was asked of the MAAS gateway, by its operation id."""

    def __init__(self, conn: asyncpg.Connection) -> None:
        self.conn = conn

    async def insert(
        self, operation_id: str, slug: str, kind: str, site: str, params: dict[str, Any], profile: str | None = None
    ) -> None:
        await self.conn.execute(
            "INSERT INTO maas_requests (operation_id, slug, kind, site, profile, params) "
            "VALUES ($1, $2, $3, $4, $5, $6)",
            operation_id,
            slug,
            kind,
            site,
            profile,
            json.dumps(params),
        )

    async def lock(self, operation_id: str) -> dict[str, Any] | None:
        return _row(
            await self.conn.fetchrow("SELECT * FROM maas_requests WHERE operation_id = $1 FOR UPDATE", operation_id)
        )

    async def get(self, operation_id: str) -> dict[str, Any] | None:
        return _row(await self.conn.fetchrow("SELECT * FROM maas_requests WHERE operation_id = $1", operation_id))

    async def of_image(self, slug: str, limit: int) -> list[dict[str, Any]]:
        """Newest first."""
        return _rows(
            await self.conn.fetch(
                "SELECT * FROM maas_requests WHERE slug = $1 ORDER BY created_at DESC LIMIT $2", slug, limit
            )
        )

    async def close(self, operation_id: str, status: str, result: dict[str, Any]) -> None:
        await self.conn.execute(
            "UPDATE maas_requests SET status = $2, result = $3, updated_at = now() WHERE operation_id = $1",
            operation_id,
            status,
            json.dumps(result),
        )


@dataclass
class ImagePipelineRepositories:
    images: ImageRepository
    hosts: SliceHostRepository
    builds: BuildRepository
    maas_requests: MaasRequestRepository
    tenancies: TenancyRepository


def image_pipeline_repositories(conn: asyncpg.Connection) -> ImagePipelineRepositories:
    """The factory a UnitOfWork (the bus's, the admin API's, the build runner's) builds `uow.repos` with."""
    return ImagePipelineRepositories(
        ImageRepository(conn),
        SliceHostRepository(conn),
        BuildRepository(conn),
        MaasRequestRepository(conn),
        TenancyRepository(conn),
    )


SCHEMA, SERVICE = "image_pipeline", "image-pipeline"


def unit_of_work(pool: asyncpg.Pool) -> Callable[[str | None], UnitOfWork[ImagePipelineRepositories]]:
    """The build runner's units of work on `pool`, one per step, each named by the build it works for."""

    def open_one(correlation_id: str | None = None) -> UnitOfWork[ImagePipelineRepositories]:
        return UnitOfWork(pool, SCHEMA, SERVICE, image_pipeline_repositories, correlation_id=correlation_id)

    return open_one


class PoolLeases:
    """Build leases renewed on a pooled connection, outside any transaction: the renewal writes nothing else."""

    def __init__(self, pool: asyncpg.Pool) -> None:
        self.pool = pool

    async def renew(self, build_id: str, owner: str, lease_s: float) -> bool:
        async with self.pool.acquire() as conn:
            return await BuildRepository(conn).renew(build_id, owner, lease_s)
