"""The `admin_requests` table: one row per authenticated mutation (who, what, when, request id), refusals
included."""

from __future__ import annotations

import asyncpg

from ..logging import get_logger
from ..unit_of_work import UnitOfWork, no_repositories

log = get_logger(__name__)


async def audit(
    conn: asyncpg.Connection,
    record: dict,
    status: int,
    *,
    replayed: bool = False,
    error_code: str | None = None,
) -> None:
    await conn.execute(
        "INSERT INTO admin_requests (request_id, principal, actor, method, path, body_sha256, idempotency_key, "
        "status, replayed, error_code) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)",
        record["request_id"],
        record["principal"],
        record["actor"],
        record["method"],
        record["path"],
        record["body_sha256"],
        record["idempotency_key"],
        status,
        replayed,
        error_code,
    )


async def audit_refusal(pool: asyncpg.Pool, schema: str, service: str, record: dict, status: int, code: str) -> None:
    """After the rollback, in a transaction of its own: a refusal is audited, its effects are not kept."""
    try:
        async with UnitOfWork(pool, schema, service, no_repositories) as uow:
            await audit(uow.conn, record, status, error_code=code)
            await uow.commit()
    except Exception as exc:  # the refusal itself still reaches the client
        log.error("admin_audit_failed", error=repr(exc))
