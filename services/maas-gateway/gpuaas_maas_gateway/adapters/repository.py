"""Every SQL statement of the gateway. The service layer reaches Postgres only through these classes.

They run on whatever they are given: a unit of work's connection for writes (so the state change, its
side rows and its outbox rows commit together), or the pool for the worker's reads, which decide
nothing on their own: every state change they lead to is a conditional write re-checked here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import asyncpg

# An asyncpg Pool has the same fetch/execute surface as a Connection (one statement, autocommit).
Executor = asyncpg.Connection | asyncpg.Pool

OPEN_STATES = ("pending", "submitting", "unknown", "accepted")
# The partial unique index of migration 004: at most one operation per machine whose MAAS call may be in
# flight or whose outcome is unknown.
MACHINE_IN_DOUBT_INDEX = "maas_operations_one_in_doubt_per_machine"


class OperationRepository:
    def __init__(self, conn: Executor) -> None:
        self.conn = conn

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
        erase: bool | None,
        params: dict[str, Any],
        deadline_at: datetime,
    ) -> bool:
        """False when the operation was already recorded (a redelivered or repeated command)."""
        return bool(
            await self.conn.fetchval(
                "INSERT INTO maas_operations (operation_id, kind, allocation_id, site, system_id, node_id, profile, "
                "erase, params, state, deadline_at) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9::jsonb, 'pending', $10) "
                "ON CONFLICT (operation_id) DO NOTHING RETURNING 1",
                operation_id,
                kind,
                allocation_id,
                site,
                system_id,
                node_id,
                profile,
                erase,
                json.dumps(params),
                deadline_at,
            )
        )

    async def interrupted_calls_are_unknown(self) -> None:
        await self.conn.execute(
            "UPDATE maas_operations SET state = 'unknown', unknown_since = COALESCE(unknown_since, now()), "
            "resolution = 'polled', updated_at = now() WHERE state = 'submitting'"
        )

    async def due(self, limit: int = 500) -> list[asyncpg.Record]:
        return await self.conn.fetch(
            "SELECT operation_id, site FROM maas_operations WHERE state = ANY($1::text[]) "
            "AND next_attempt_at <= now() ORDER BY next_attempt_at LIMIT $2",
            list(OPEN_STATES),
            limit,
        )

    async def get(self, operation_id: str) -> asyncpg.Record | None:
        return await self.conn.fetchrow("SELECT * FROM maas_operations WHERE operation_id = $1", operation_id)

    async def lock(self, operation_id: str) -> asyncpg.Record | None:
        return await self.conn.fetchrow(
            "SELECT * FROM maas_operations WHERE operation_id = $1 FOR UPDATE", operation_id
        )

    async def machine_busy(self, site: str, system_id: str, operation_id: str) -> bool:
        """A cheap early look; the unique index is what actually keeps two calls apart."""
        return bool(
            await self.conn.fetchval(
                "SELECT 1 FROM maas_operations WHERE site = $1 AND system_id = $2 AND operation_id <> $3 "
                "AND state IN ('submitting', 'unknown')",
                site,
                system_id,
                operation_id,
            )
        )

    async def start_submit(self, operation_id: str) -> str:
        """Move a pending operation to `submitting`: 'started', 'not_pending' (another worker took it) or
        'machine_busy' (another operation on the machine is submitting or unknown)."""
        try:
            # A savepoint, so a refused update leaves the caller's transaction usable.
            async with self.conn.transaction():
                started = await self.conn.fetchval(
                    "UPDATE maas_operations SET state = 'submitting', maas_calls = maas_calls + 1, "
                    "updated_at = now() WHERE operation_id = $1 AND state = 'pending' RETURNING 1",
                    operation_id,
                )
        except asyncpg.UniqueViolationError as exc:
            if exc.constraint_name != MACHINE_IN_DOUBT_INDEX:
                raise
            return "machine_busy"
        return "started" if started else "not_pending"

    async def start_tag_sync(self, operation_id: str) -> None:
        await self.conn.execute(
            "UPDATE maas_operations SET maas_calls = maas_calls + 1, state = 'submitting' WHERE operation_id = $1",
            operation_id,
        )

    async def update(self, operation_id: str, *, delay: float, **fields: Any) -> None:
        sets = ["updated_at = now()", f"next_attempt_at = now() + make_interval(secs => ${len(fields) + 2})"]
        sets += [f"{col} = ${i}" + ("::jsonb" if col == "progress" else "") for i, col in enumerate(fields, start=2)]
        await self.conn.execute(
            f"UPDATE maas_operations SET {', '.join(sets)} WHERE operation_id = $1",
            operation_id,
            *fields.values(),
            float(delay),
        )

    async def merge_progress(self, operation_id: str, progress: dict[str, Any]) -> None:
        await self.conn.execute(
            "UPDATE maas_operations SET progress = progress || $2::jsonb WHERE operation_id = $1",
            operation_id,
            json.dumps(progress),
        )

    async def back_to_pending(self, operation_id: str, last_status: str) -> None:
        await self.conn.execute(
            "UPDATE maas_operations SET state = 'pending', unknown_since = NULL, resubmits = resubmits + 1, "
            "last_status = $2, next_attempt_at = now(), updated_at = now() "
            "WHERE operation_id = $1 AND state = 'unknown'",
            operation_id,
            last_status,
        )

    async def finish(
        self, operation_id: str, outcome: str, *, status: str | None, message: str | None, result: dict[str, Any]
    ) -> None:
        await self.conn.execute(
            "UPDATE maas_operations SET state = $2, last_status = COALESCE($3, last_status), "
            "status_message = $4, result = $5::jsonb, updated_at = now() WHERE operation_id = $1",
            operation_id,
            outcome,
            status,
            message,
            json.dumps(result),
        )

    async def deployed_with_profile(self, allocation_id: Any) -> str | None:
        return await self.conn.fetchval(
            "SELECT profile FROM maas_operations WHERE allocation_id = $1 AND kind = 'deploy' "
            "ORDER BY created_at DESC LIMIT 1",
            allocation_id,
        )


class SiteCatalogRepository:
    """What ops changed at run time per site: a profile's image, the boot resources uploaded."""

    def __init__(self, conn: Executor) -> None:
        self.conn = conn

    async def distro_series_override(self, site: str, profile: str | None) -> str | None:
        return await self.conn.fetchval(
            "SELECT distro_series FROM maas_site_profiles WHERE site = $1 AND profile = $2", site, profile
        )

    async def set_distro_series(self, site: str, profile: str, distro_series: str, operation_id: str) -> None:
        await self.conn.execute(
            "INSERT INTO maas_site_profiles (site, profile, distro_series, operation_id) VALUES ($1, $2, $3, $4) "
            "ON CONFLICT (site, profile) DO UPDATE SET distro_series = EXCLUDED.distro_series, "
            "operation_id = EXCLUDED.operation_id, updated_at = now()",
            site,
            profile,
            distro_series,
            operation_id,
        )

    async def uploaded_images(self, site: str) -> set[str]:
        return {r["name"] for r in await self.conn.fetch("SELECT name FROM maas_boot_resources WHERE site = $1", site)}

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
    ) -> None:
        await self.conn.execute(
            "INSERT INTO maas_boot_resources (site, name, architecture, boot_resource_id, filetype, sha256, "
            "size, operation_id) VALUES ($1, $2, $3, $4, $5, $6, $7, $8) ON CONFLICT (site, name, architecture) "
            "DO UPDATE SET boot_resource_id = EXCLUDED.boot_resource_id, filetype = EXCLUDED.filetype, "
            "sha256 = EXCLUDED.sha256, size = EXCLUDED.size, operation_id = EXCLUDED.operation_id, "
            "uploaded_at = now()",
            site,
            name,
            architecture,
            boot_resource_id,
            filetype,
            sha256,
            size,
            operation_id,
        )


class HostCredentialRepository:
    """Public keys of the NATS users minted for baremetal hosts (the seeds are never stored)."""

    def __init__(self, conn: Executor) -> None:
        self.conn = conn

    async def record(self, user_public: str, allocation_id: str, node_id: str, expires_at: datetime) -> None:
        await self.conn.execute(
            "INSERT INTO maas_host_credentials (user_public, allocation_id, node_id, expires_at) "
            "VALUES ($1, $2, $3, $4)",
            user_public,
            allocation_id,
            node_id,
            expires_at,
        )

    async def live(self, allocation_id: str) -> list[str]:
        rows = await self.conn.fetch(
            "SELECT user_public FROM maas_host_credentials WHERE allocation_id = $1 AND revoked_at IS NULL",
            allocation_id,
        )
        return [r["user_public"] for r in rows]

    async def mark_revoked(self, user_publics: list[str]) -> None:
        await self.conn.execute(
            "UPDATE maas_host_credentials SET revoked_at = now() WHERE user_public = ANY($1::text[])", user_publics
        )


@dataclass
class GatewayRepositories:
    operations: OperationRepository
    catalog: SiteCatalogRepository
    host_credentials: HostCredentialRepository


def gateway_repositories(conn: Executor) -> GatewayRepositories:
    """The factory a UnitOfWork (and the bus) builds `uow.repos` with."""
    return GatewayRepositories(OperationRepository(conn), SiteCatalogRepository(conn), HostCredentialRepository(conn))
