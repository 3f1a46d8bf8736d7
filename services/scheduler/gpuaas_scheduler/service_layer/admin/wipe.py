"""Site wipe policies: which destructive wipe a site (region) requires between tenants."""

from __future__ import annotations

import re

import asyncpg

from ...adapters import admin_nodes as audit_repo
from ...adapters import wipe_policy as repo
from .common import jsonable
from .models import AdminError, SiteWipePolicyIn

# A site is named as a node's region is.
REGION = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


async def get_site_wipe_policy(conn: asyncpg.Connection, region: str) -> dict:
    row = await repo.site_policy(conn, region)
    return {"region": region, "site_policy": jsonable(row) if row else None}


async def set_site_wipe_policy(conn: asyncpg.Connection, region: str, body: SiteWipePolicyIn) -> dict:
    """Set the site's policy and record it on every slot of the region. A slot under a live claim was placed
    with its previous policy, so its agent wipes by that one while the release proof is judged against the new
    one: unless the methods agree it lands in cleanup_blocked (fail closed). Those slots are listed."""
    if not REGION.match(region):
        raise AdminError(422, "invalid_region", "region is not a site name (letters, digits, ._-)")
    await repo.lock_region_nodes(conn, region)
    previous = await repo.site_policy(conn, region)
    changed = await repo.set_site_policy(
        conn, region, body.destructive_wipe_policy, actor=body.actor, reason=body.reason
    )
    in_use = await repo.claimed_slots(conn, changed)
    await audit_repo.audit(
        conn,
        body.actor,
        "site.wipe_policy",
        region,
        body.reason,
        {
            "policy": body.destructive_wipe_policy,
            "previous": previous["destructive_wipe_policy"] if previous else None,
            "slots_updated": changed,
            "slots_in_use": in_use,
        },
    )
    return {**(await get_site_wipe_policy(conn, region)), "slots_updated": changed, "slots_in_use": in_use}
