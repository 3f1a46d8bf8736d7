"""Site wipe policies: which destructive wipe a site (region) requires between tenants."""

from __future__ import annotations

import re
from typing import Any

from ..ports import AdminUnitOfWork, WipePolicies
from .common import jsonable
from .models import AdminError, SiteWipePolicyIn

# A site is named as a node's region is.
REGION = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


async def get_site_wipe_policy(policies: WipePolicies, region: str) -> dict[str, Any]:
    row = await policies.site(region)
    return {"region": region, "site_policy": jsonable(row) if row else None}


async def set_site_wipe_policy(uow: AdminUnitOfWork, region: str, body: SiteWipePolicyIn) -> dict[str, Any]:
    """Set the site's policy and record it on every slot of the region. A slot under a live claim was placed
    with its previous policy, so its agent wipes by that one while the release proof is judged against the new
    one: unless the methods agree it lands in cleanup_blocked (fail closed). Those slots are listed."""
    if not REGION.match(region):
        raise AdminError(422, "invalid_region", "region is not a site name (letters, digits, ._-)")
    policies = uow.repos.wipe_policies
    await policies.lock_region(region)
    previous = await policies.site(region)
    policy = body.destructive_wipe_policy
    changed = await policies.set_site(region, policy, actor=body.actor, reason=body.reason)
    in_use = await policies.claimed(changed)
    before = previous["destructive_wipe_policy"] if previous else None
    detail = {"policy": policy, "previous": before, "slots_updated": changed, "slots_in_use": in_use}
    await uow.repos.audit.record(body.actor, "site.wipe_policy", region, body.reason, detail)
    return {**(await get_site_wipe_policy(policies, region)), "slots_updated": changed, "slots_in_use": in_use}
