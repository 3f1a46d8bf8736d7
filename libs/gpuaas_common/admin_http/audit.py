"""The `admin_requests` table: one row per authenticated mutation (who, what, when, request id), refusals
included; and, for a service that names its audit event, the same record on the bus (`AdminRequestRecorded`, why
included), written to the outbox in the transaction of the row, so ops read every service's audit in one place
(ops-view) without reading any service's tables."""

from __future__ import annotations

import json

import asyncpg

from ..contract.catalog import spec_for
from ..logging import get_logger
from ..unit_of_work import UnitOfWork, no_repositories
from .headers import KEY_RE

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


def _storable(text: str) -> str:
    # Postgres text holds no NUL nor a lone surrogate: what a hostile request carried must not cost the audit of
    # its refusal.
    return text.encode("utf-8", "replace").decode().replace("\x00", "")


def reason_of(raw: bytes) -> str | None:
    """The body's `reason`, the why every admin change of this project carries; None where it has none."""
    try:
        body = json.loads(raw) if raw else None
    except ValueError:
        return None
    reason = body.get("reason") if isinstance(body, dict) else None
    return reason[:2048] if isinstance(reason, str) and reason else None


async def announce(
    uow: UnitOfWork,
    event_type: str | None,
    service: str,
    record: dict,
    status: int,
    *,
    replayed: bool = False,
    error_code: str | None = None,
) -> None:
    """The audit row's event, in the same unit of work (nothing when the service names no audit event)."""
    if event_type is None:
        return
    key, reason = record["idempotency_key"], record.get("reason")
    payload = spec_for(event_type).model(
        service=service,
        request_id=record["request_id"],
        principal=record["principal"],
        actor=record["actor"],
        method=record["method"],
        path=_storable(record["path"])[:2048],
        status=status,
        error_code=error_code,
        replayed=replayed,
        # A refusal may be for the key itself: one that breaks the header rule is not repeated.
        idempotency_key=key if key and KEY_RE.match(key) else None,
        reason=_storable(reason) if reason else None,
        body_sha256=record["body_sha256"],
    )
    await uow.events.add(event_type, payload, aggregate_id=record["request_id"])


async def audit_refusal(
    pool: asyncpg.Pool,
    schema: str,
    service: str,
    record: dict,
    status: int,
    code: str,
    event_type: str | None = None,
) -> None:
    """After the rollback, in a transaction of its own: a refusal is audited, its effects are not kept."""
    try:
        async with UnitOfWork(pool, schema, service, no_repositories) as uow:
            await audit(uow.conn, record, status, error_code=code)
            await announce(uow, event_type, service, record, status, error_code=code)
            await uow.commit()
    except Exception as exc:  # the refusal itself still reaches the client
        log.error("admin_audit_failed", error=repr(exc))
