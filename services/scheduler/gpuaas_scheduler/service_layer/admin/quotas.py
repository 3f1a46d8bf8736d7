"""Tenant GPU quotas: the limit placement enforces, and what the tenant holds now."""

from __future__ import annotations

import re

import asyncpg

from ...adapters import admin_nodes as repo
from .common import jsonable
from .models import AdminError, QuotaIn

TENANT_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")


async def set_quota(conn: asyncpg.Connection, tenant_id: str, body: QuotaIn) -> dict:
    if not TENANT_ID.match(tenant_id):
        raise AdminError(422, "invalid_tenant", "tenant id is not an identifier")
    await repo.upsert_quota(conn, tenant_id, body.max_gpus, actor=body.actor, reason=body.reason)
    await repo.audit(conn, body.actor, "tenant.quota", tenant_id, body.reason, {"max_gpus": body.max_gpus})
    return await get_quota(conn, tenant_id)


async def get_quota(conn: asyncpg.Connection, tenant_id: str) -> dict:
    row = await repo.quota(conn, tenant_id)
    used = await repo.gpus_in_use(conn, tenant_id)
    return {"tenant_id": tenant_id, "quota": jsonable(row) if row else None, "gpus_in_use": used}
