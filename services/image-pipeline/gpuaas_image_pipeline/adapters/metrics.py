"""The image pipeline's readings for /metrics (`gpuaas_common.metrics`): each image's node caches by state, the
catalog by kind and status, and builds by status. Read from its own tables when it is scraped."""

from __future__ import annotations

from typing import Any

from gpuaas_common.metrics import Family, Reading, Sample

CACHE_STATES = ("absent", "pulling", "verified", "mismatch", "failed")

IMAGE_CACHES = Family(
    "gpuaas_image_node_caches", "Hosts' caches of each image by state (as the hosts last reported)", ("slug", "status")
)
CACHE_TOTALS = Family("gpuaas_image_caches", "Hosts' image caches (all images) in each state", ("status",))
IMAGES = Family("gpuaas_images", "Catalog images by kind and status", ("kind", "status"))
BUILDS = Family("gpuaas_image_builds", "Image builds by status", ("status",))


def catalog_reading(pool: Any) -> Reading:
    async def read() -> list[Sample]:
        async with pool.acquire() as conn:
            caches = await conn.fetch(
                "SELECT slug, status, count(*) AS n FROM node_image_cache GROUP BY slug, status ORDER BY slug, status"
            )
            images = await conn.fetch("SELECT kind, status, count(*) AS n FROM os_images GROUP BY kind, status")
            builds = await conn.fetch("SELECT status, count(*) AS n FROM builds GROUP BY status")
        out = [IMAGE_CACHES(r["slug"], r["status"], value=r["n"]) for r in caches]
        totals: dict[str, int] = dict.fromkeys(CACHE_STATES, 0)
        for r in caches:
            totals[r["status"]] = totals.get(r["status"], 0) + r["n"]
        out += [CACHE_TOTALS(status, value=n) for status, n in totals.items()]
        out += [IMAGES(r["kind"], r["status"], value=r["n"]) for r in images]
        out += [BUILDS(r["status"], value=r["n"]) for r in builds]
        return out

    return read
