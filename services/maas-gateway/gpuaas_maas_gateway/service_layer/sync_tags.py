"""Sync a site profile's tags: create missing tags, add/remove machines. Idempotent in effect, so an
unknown outcome is simply run again."""

from __future__ import annotations

import re
from functools import partial

from ..adapters.maas_errors import MaasBadRequest, MaasError, MaasUnreachable
from .metrics import UNKNOWN_OUTCOMES
from .ports import Row
from .shared import Operations, Site, Unresolvable, now, params

TAG_NAME = re.compile(r"^[a-zA-Z0-9_-]+$")


async def step(ops: Operations, site: Site, row: Row) -> None:
    _, profile = await ops.profile(row["site"], row["profile"])
    bad = [t for t in profile.tags if not TAG_NAME.match(t)]
    if bad:
        raise Unresolvable("invalid_tag", f"tag names must match {TAG_NAME.pattern}: {bad}")
    p = params(row)
    await ops.write(lambda repos: repos.operations.start_tag_sync(row["operation_id"]))
    added = removed = 0
    try:
        existing = {t["name"] for t in await ops.maas(site, site.client.list_tags)}
        for tag in profile.tags:
            if tag not in existing:
                try:
                    await ops.maas(
                        site,
                        partial(site.client.create_tag, tag, comment=f"gpuaas site profile {row['profile']}"),
                    )
                except MaasBadRequest as exc:
                    if "already exists" not in exc.body:
                        raise
            if p.get("add_system_ids") or p.get("remove_system_ids"):
                counts = await ops.maas(
                    site,
                    partial(
                        site.client.update_tag_nodes,
                        tag,
                        add=p.get("add_system_ids") or (),
                        remove=p.get("remove_system_ids") or (),
                    ),
                )
                added += int(counts.get("added", 0))
                removed += int(counts.get("removed", 0))
    except MaasError as exc:
        if exc.outcome_unknown or isinstance(exc, MaasUnreachable) or exc.retry_after is not None:
            if exc.outcome_unknown:
                UNKNOWN_OUTCOMES.labels("sync_tags").inc()
            await ops.set(
                row["operation_id"],
                state="unknown",
                resolution="polled",
                unknown_since=row["unknown_since"] or now(),
                last_error=str(exc)[:500],
                delay=ops.retry_delay(exc),
            )
            return
        await ops.finish(row, "failed", reason_code=f"maas_http_{exc.status}", message=exc.body[:500])
        return
    await ops.finish(row, "succeeded", result={"tags": list(profile.tags), "added": added, "removed": removed})
