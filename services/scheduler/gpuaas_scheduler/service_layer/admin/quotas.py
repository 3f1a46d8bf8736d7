"""Tenant GPU quotas: the limit placement enforces, and what the tenant holds now."""

from __future__ import annotations

import re
from typing import Any

from ..ports import AdminUnitOfWork, Quotas
from .common import jsonable
from .models import AdminError, QuotaIn

TENANT_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")


async def set_quota(uow: AdminUnitOfWork, tenant_id: str, body: QuotaIn) -> dict[str, Any]:
    if not TENANT_ID.match(tenant_id):
        raise AdminError(422, "invalid_tenant", "tenant id is not an identifier")
    await uow.repos.quotas.set(tenant_id, body.max_gpus, actor=body.actor, reason=body.reason)
    await uow.repos.audit.record(body.actor, "tenant.quota", tenant_id, body.reason, {"max_gpus": body.max_gpus})
    return await get_quota(uow.repos.quotas, tenant_id)


async def get_quota(quotas: Quotas, tenant_id: str) -> dict[str, Any]:
    row = await quotas.get(tenant_id)
    used = await quotas.gpus_in_use(tenant_id)
    return {"tenant_id": tenant_id, "quota": jsonable(row) if row else None, "gpus_in_use": used}
