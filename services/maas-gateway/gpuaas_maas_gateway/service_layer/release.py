"""Release: the host's bus identity is revoked first, then MAAS takes the machine back (and erases it)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import asyncpg

from .machine import machine_step
from .shared import Operations, Site


async def prepare(ops: Operations, site: Site, row: asyncpg.Record) -> Callable[[], Awaitable[Any]] | None:
    # The host's bus identity ends before MAAS takes the machine back: the tenant still has root.
    if not await ops.revoke_host_credentials(row):
        return None
    # The erase policy is the profile's the machine was deployed with.
    deployed_with = await ops.read.operations.deployed_with_profile(row["allocation_id"])
    profile = ops.settings.site_profiles.get(deployed_with or "") or next(
        iter(ops.settings.site_profiles.values()), None
    )
    erase = row["erase"] if row["erase"] is not None else (profile.erase_on_release if profile else True)
    quick = bool(profile and profile.quick_erase)
    return lambda: site.client.release(
        row["system_id"], erase=erase, quick_erase=erase and quick, comment=f"gpuaas release {row['allocation_id']}"
    )


step = machine_step(prepare)
