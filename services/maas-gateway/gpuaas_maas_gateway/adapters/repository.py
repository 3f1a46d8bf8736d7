"""Every SQL statement of the gateway. The service layer reaches Postgres only through these classes (its ports,
service_layer/ports.py); rows come out as plain dicts.

They run on whatever they are given: a unit of work's connection for writes (so the state change, its
side rows and its outbox rows commit together), or the pool for the worker's reads, which decide
nothing on their own: every state change they lead to is a conditional write re-checked here.

Replicas of the gateway share `maas_operations`; an operation is stepped only by the worker holding its
lease (migration 005). A repository built with a `lease_owner` fences every write of a step on that
lease: when it is no longer ours (it ran out and another worker took the operation over), the write
changes nothing and raises LeaseLost, so a stalled worker cannot overwrite its successor's progress.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import asyncpg

from gpuaas_common.unit_of_work import UnitOfWork

# An asyncpg Pool has the same fetch/execute surface as a Connection (one statement, autocommit).
Executor = asyncpg.Connection | asyncpg.Pool

OPEN_STATES = ("pending", "submitting", "unknown", "accepted")
# The partial unique index of migration 004: at most one operation per machine whose MAAS call may be in
# flight or whose outcome is unknown.
MACHINE_IN_DOUBT_INDEX = "maas_operations_one_in_doubt_per_machine"

# Taking a lease over a `submitting` row means its call was interrupted (the worker died or lost its
# lease mid-call, or the step ended without recording the answer): its outcome is unknown. The SET
# expressions see the row as it was before the update.
_TAKE_LEASE = (
    "lease_owner = $2, lease_until = now() + make_interval(secs => $3), "
    "state = CASE WHEN o.state = 'submitting' THEN 'unknown' ELSE o.state END, "
    "unknown_since = CASE WHEN o.state = 'submitting' THEN COALESCE(o.unknown_since, now()) "
    "ELSE o.unknown_since END, "
    "resolution = CASE WHEN o.state = 'submitting' THEN 'polled' ELSE o.resolution END, "
    "updated_at = CASE WHEN o.state = 'submitting' THEN now() ELSE o.updated_at END"
)


class LeaseLost(Exception):
    """The operation's lease is no longer this worker's: another worker has taken the operation over."""

    def __init__(self, operation_id: str) -> None:
        super().__init__(f"the lease of operation {operation_id} is no longer ours")
        self.operation_id = operation_id


def _changed(status: str) -> int:
    return int(status.split()[-1])


def _row(record: asyncpg.Record | None) -> dict[str, Any] | None:
    return None if record is None else dict(record)


class OperationRepository:
    def __init__(self, conn: Executor, *, lease_owner: str | None = None, lease_s: float = 0.0) -> None:
        self.conn = conn
        self.lease_owner = lease_owner
        self.lease_s = lease_s

    def _fence(self, n: int) -> str:
        """The WHERE condition that keeps a worker's write to the operations it holds the lease of."""
        return f" AND lease_owner = ${n}" if self.lease_owner is not None else ""

    def _fence_args(self) -> tuple[str, ...]:
        return (self.lease_owner,) if self.lease_owner is not None else ()

    def _fenced(self, operation_id: str, status: str) -> None:
        if self.lease_owner is not None and _changed(status) == 0:
            raise LeaseLost(operation_id)

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
        return bool(
            await self.conn.fetchval(
                "INSERT INTO maas_operations (operation_id, kind, allocation_id, site, system_id, node_id, profile, "
                "params, state, deadline_at) VALUES ($1, $2, $3, $4, $5, $6, $7, $8::jsonb, 'pending', $9) "
                "ON CONFLICT (operation_id) DO NOTHING RETURNING 1",
                operation_id,
                kind,
                allocation_id,
                site,
                system_id,
                node_id,
                profile,
                json.dumps(params),
                deadline_at,
            )
        )

    async def refresh_command_seq(self, operation_id: str, seq: int) -> bool:
        """An open deploy asked again: from now on its mints name this newer command (the credential authority
        mints only for a recent one). Never moves back to an older command; False when nothing changed."""
        status = await self.conn.execute(
            "UPDATE maas_operations SET params = jsonb_set(params, '{command_seq}', to_jsonb($2::bigint)) "
            "WHERE operation_id = $1 AND kind = 'deploy' AND state = ANY($3::text[]) "
            "AND COALESCE((params->>'command_seq')::bigint, 0) < $2",
            operation_id,
            seq,
            list(OPEN_STATES),
        )
        return status == "UPDATE 1"

    async def claim_due(
        self, owner: str, lease_s: float, limit: int, stepping: list[str] | tuple[str, ...] = ()
    ) -> list[dict[str, Any]]:
        """Lease up to `limit` due operations to `owner`: those whose lease is free or has expired, except
        the ones `owner` is stepping right now (a renewal that came late must not turn its own call into
        an unknown one). SKIP LOCKED lets replicas claim at once without waiting on each other or taking
        the same row."""
        rows = await self.conn.fetch(
            f"UPDATE maas_operations o SET {_TAKE_LEASE} FROM ("
            "SELECT operation_id FROM maas_operations WHERE state = ANY($1::text[]) AND next_attempt_at <= now() "
            "AND (lease_until IS NULL OR lease_until < now()) AND operation_id <> ALL($5::text[]) "
            "ORDER BY next_attempt_at LIMIT $4 FOR UPDATE SKIP LOCKED) due "
            "WHERE o.operation_id = due.operation_id RETURNING o.operation_id, o.site",
            list(OPEN_STATES),
            owner,
            float(lease_s),
            limit,
            list(stepping),
        )
        return [dict(r) for r in rows]

    async def claim(self, operation_id: str, owner: str, lease_s: float) -> dict[str, Any] | None:
        """Lease one operation to `owner` (already ours, free or expired), whatever its next attempt time;
        None when it is closed or another worker holds it."""
        return _row(
            await self.conn.fetchrow(
                f"UPDATE maas_operations o SET {_TAKE_LEASE} WHERE o.operation_id = $1 AND o.state = ANY($4::text[]) "
                "AND (o.lease_owner = $2 OR o.lease_until IS NULL OR o.lease_until < now()) RETURNING o.*",
                operation_id,
                owner,
                float(lease_s),
                list(OPEN_STATES),
            )
        )

    async def renew(self, operation_id: str, owner: str, lease_s: float) -> bool:
        return bool(
            await self.conn.fetchval(
                "UPDATE maas_operations SET lease_until = now() + make_interval(secs => $3) "
                "WHERE operation_id = $1 AND lease_owner = $2 RETURNING 1",
                operation_id,
                owner,
                float(lease_s),
            )
        )

    async def release(self, operation_id: str, owner: str) -> None:
        await self.conn.execute(
            "UPDATE maas_operations SET lease_owner = NULL, lease_until = NULL WHERE operation_id = $1 "
            "AND lease_owner = $2",
            operation_id,
            owner,
        )

    async def get(self, operation_id: str) -> dict[str, Any] | None:
        return _row(await self.conn.fetchrow("SELECT * FROM maas_operations WHERE operation_id = $1", operation_id))

    async def lock(self, operation_id: str) -> dict[str, Any] | None:
        return _row(
            await self.conn.fetchrow("SELECT * FROM maas_operations WHERE operation_id = $1 FOR UPDATE", operation_id)
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
        """Move a pending operation to `submitting`: 'started', 'not_pending' (another worker took it, or
        our lease ran out) or 'machine_busy' (another operation on the machine is submitting or unknown)."""
        # A savepoint, so a refused update leaves the caller's transaction usable.
        await self.conn.execute("SAVEPOINT start_submit")
        try:
            # The call starts with a fresh lease, longer than the call's timeout: nobody takes the
            # operation over while the call may still reach MAAS. A lease that already ran out
            # starts nothing.
            fence = " AND lease_owner = $2 AND lease_until > now()" if self.lease_owner is not None else ""
            renew = ", lease_until = now() + make_interval(secs => $3)" if self.lease_owner is not None else ""
            started = await self.conn.fetchval(
                f"UPDATE maas_operations SET state = 'submitting', maas_calls = maas_calls + 1, "
                f"updated_at = now(){renew} WHERE operation_id = $1 AND state = 'pending'{fence} RETURNING 1",
                operation_id,
                *((self.lease_owner, float(self.lease_s)) if self.lease_owner is not None else ()),
            )
        except asyncpg.UniqueViolationError as exc:
            await self.conn.execute("ROLLBACK TO SAVEPOINT start_submit; RELEASE SAVEPOINT start_submit")
            if exc.constraint_name != MACHINE_IN_DOUBT_INDEX:
                raise
            return "machine_busy"
        await self.conn.execute("RELEASE SAVEPOINT start_submit")
        return "started" if started else "not_pending"

    async def start_tag_sync(self, operation_id: str) -> None:
        status = await self.conn.execute(
            "UPDATE maas_operations SET maas_calls = maas_calls + 1, state = 'submitting' WHERE operation_id = $1"
            + self._fence(2),
            operation_id,
            *self._fence_args(),
        )
        self._fenced(operation_id, status)

    async def update(self, operation_id: str, *, delay: float, **fields: Any) -> None:
        sets = ["updated_at = now()", f"next_attempt_at = now() + make_interval(secs => ${len(fields) + 2})"]
        sets += [f"{col} = ${i}" + ("::jsonb" if col == "progress" else "") for i, col in enumerate(fields, start=2)]
        status = await self.conn.execute(
            f"UPDATE maas_operations SET {', '.join(sets)} WHERE operation_id = $1" + self._fence(len(fields) + 3),
            operation_id,
            *fields.values(),
            float(delay),
            *self._fence_args(),
        )
        self._fenced(operation_id, status)

    async def merge_progress(self, operation_id: str, progress: dict[str, Any]) -> None:
        status = await self.conn.execute(
            "UPDATE maas_operations SET progress = progress || $2::jsonb WHERE operation_id = $1" + self._fence(3),
            operation_id,
            json.dumps(progress),
            *self._fence_args(),
        )
        self._fenced(operation_id, status)

    async def back_to_pending(self, operation_id: str, last_status: str) -> None:
        await self.conn.execute(
            "UPDATE maas_operations SET state = 'pending', unknown_since = NULL, resubmits = resubmits + 1, "
            "last_status = $2, next_attempt_at = now(), updated_at = now() "
            "WHERE operation_id = $1 AND state = 'unknown'" + self._fence(3),
            operation_id,
            last_status,
            *self._fence_args(),
        )

    async def finish(
        self,
        operation_id: str,
        outcome: str,
        *,
        status: str | None,
        message: str | None,
        result: dict[str, Any],
        reason_code: str | None = None,
    ) -> None:
        """Final: the lease goes with the open state (the caller checked the lease under the row lock)."""
        await self.conn.execute(
            "UPDATE maas_operations SET state = $2, last_status = COALESCE($3, last_status), "
            "status_message = $4, result = $5::jsonb, reason_code = $6, lease_owner = NULL, lease_until = NULL, "
            "updated_at = now() "
            "WHERE operation_id = $1",
            operation_id,
            outcome,
            status,
            message,
            json.dumps(result),
            reason_code,
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

    async def live_allocations_of_node(self, node_id: str, except_allocation: str | None) -> list[str]:
        rows = await self.conn.fetch(
            "SELECT DISTINCT allocation_id FROM maas_host_credentials WHERE node_id = $1 AND revoked_at IS NULL "
            "AND allocation_id IS DISTINCT FROM $2 ORDER BY allocation_id",
            node_id,
            except_allocation,
        )
        return [r["allocation_id"] for r in rows]

    async def mark_revoked(self, user_publics: list[str]) -> None:
        await self.conn.execute(
            "UPDATE maas_host_credentials SET revoked_at = now() WHERE user_public = ANY($1::text[])", user_publics
        )


@dataclass
class GatewayRepositories:
    operations: OperationRepository
    catalog: SiteCatalogRepository
    host_credentials: HostCredentialRepository


def gateway_repositories(
    conn: Executor, *, lease_owner: str | None = None, lease_s: float = 0.0
) -> GatewayRepositories:
    """The factory a UnitOfWork (and the bus) builds `uow.repos` with; the worker's writes name its lease."""
    return GatewayRepositories(
        OperationRepository(conn, lease_owner=lease_owner, lease_s=lease_s),
        SiteCatalogRepository(conn),
        HostCredentialRepository(conn),
    )


SCHEMA, SERVICE = "maas_gateway", "maas-gateway"


def unit_of_work_factory(
    pool: asyncpg.Pool, *, lease_owner: str | None = None, lease_s: float = 0.0
) -> Callable[..., UnitOfWork[GatewayRepositories]]:
    """Units of work on `pool`; with `lease_owner`, each of their writes is fenced on that worker's lease."""

    def repositories(conn: Any) -> GatewayRepositories:
        return gateway_repositories(conn, lease_owner=lease_owner, lease_s=lease_s)

    def factory(**kwargs: Any) -> UnitOfWork[GatewayRepositories]:
        return UnitOfWork(pool, SCHEMA, SERVICE, repositories, **kwargs)

    return factory


class PostgresGateway:
    """The worker's database (service_layer/ports.py `GatewayDatabase`) on the service's pool."""

    def __init__(self, pool: asyncpg.Pool) -> None:
        self.pool = pool
        # An asyncpg Pool runs each statement on a connection of its own, outside any transaction.
        self.reads = gateway_repositories(pool)

    def units_of_work(self, *, lease_owner: str, lease_s: float) -> Callable[..., UnitOfWork[GatewayRepositories]]:
        return unit_of_work_factory(self.pool, lease_owner=lease_owner, lease_s=lease_s)
