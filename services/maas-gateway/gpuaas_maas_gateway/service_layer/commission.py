"""Commission: named scripts made sure of first; the run is proved by a new commissioning result id."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from ..adapters.maas_errors import MaasBadRequest, MaasNotFound
from .machine import machine_step
from .ports import Row
from .shared import Operations, Site, Unresolvable, params


async def prepare(ops: Operations, site: Site, row: Row) -> Callable[[], Awaitable[Any]]:
    p = params(row)
    for script in p.get("scripts") or ():
        await _ensure_script(ops, site, script)
    # The result id before asking is what later proves whether this run happened.
    before = await ops.maas(site, lambda: site.client.read_machine(row["system_id"]))
    baseline = before.raw.get("current_commissioning_result_id")
    await ops.write(
        lambda repos: repos.operations.merge_progress(row["operation_id"], {"baseline_result_id": baseline})
    )
    return lambda: site.client.commission(
        row["system_id"],
        commissioning_scripts=p.get("commissioning_scripts") or None,
        testing_scripts=p.get("testing_scripts") or None,
    )


async def _ensure_script(ops: Operations, site: Site, script: dict[str, Any]) -> None:
    try:
        await ops.maas(site, lambda: site.client.read_script(script["name"]))
        return
    except MaasNotFound:
        pass
    try:
        await ops.maas(
            site,
            lambda: site.client.create_script(script["name"], script["script"], script.get("type", "commissioning")),
        )
    except MaasBadRequest as exc:
        # A create whose answer was lost earlier may have made it already.
        if "already exists" not in exc.body:
            raise Unresolvable("maas_http_400", f"script {script['name']}: {exc.body[:400]}") from None


step = machine_step(prepare)
