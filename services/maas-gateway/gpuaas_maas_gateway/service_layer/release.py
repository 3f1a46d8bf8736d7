"""Release: the host's bus identity is revoked first, then MAAS takes the machine back and erases its disks as the
command says (the site's wipe policy, mapped by the allocator): `secure` is MAAS's `secure_erase` (a drive without
one gets MAAS's full overwrite, as `quick_erase` is false), `full` is `erase` alone, the overwrite. Every flag is
sent, false ones too: a flag left out is MAAS's global setting, and a site whose "quick erase by default" is on
would turn either mode into a quick erase that still reports Passed."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from .machine import machine_step
from .ports import Row
from .shared import Operations, Site, release_erase_mode


async def prepare(ops: Operations, site: Site, row: Row) -> Callable[[], Awaitable[Any]] | None:
    # The host's bus identity ends before MAAS takes the machine back: the tenant still has root.
    if not await ops.revoke_host_credentials(row):
        return None
    # The newest erase run before asking: the one that answers this release is a later one.
    sets = await ops.maas(
        site, lambda: site.client.list_results(row["system_id"], result_type="release", include_output=False)
    )
    baseline = max((int(s.get("id") or 0) for s in sets), default=0)
    await ops.write(
        lambda repos: repos.operations.merge_progress(row["operation_id"], {"erase_baseline_set_id": baseline})
    )
    secure = release_erase_mode(row) == "secure"
    return lambda: site.client.release(
        row["system_id"],
        erase=True,
        secure_erase=secure,
        quick_erase=False,
        comment=f"gpuaas release {row['allocation_id']}",
    )


step = machine_step(prepare)
