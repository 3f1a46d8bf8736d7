"""Apply seed data to the catalog without ever reverting what was already materialised.

A seeded slice image has no artifact: the hosts' provisioning puts it in their caches. Every known slice
host is asked to check that it holds it (hosts enrolled later are asked on enrolment), so the catalog's
cache view says where it really is instead of showing it absent everywhere. It passes the activation gate as
a built image does: `published` until every slice host verified its digest, never announced active before.
"""

from __future__ import annotations

import uuid

from gpuaas_common.contract import derived_event_id
from gpuaas_common.contract import messages as m

from ..domain.catalog import SeedImage, activation_event_key
from .catalog import Uow, _meta, evaluate_gate, prewarm_everywhere


async def apply_seed(uow: Uow, seeds: list[SeedImage]) -> list[str]:
    activated = []
    for seed in seeds:
        await uow.repos.images.seed(seed)
    for row in await uow.repos.images.active():
        meta = row["metadata"]
        await uow.events.add(
            "image.activated",
            m.ImageActivated(
                slug=row["slug"],
                kind=row["kind"],
                sku=row["compatible_sku"],
                digest_sha256=row["digest_sha256"],
                image_path=meta["image_path"],
                source_uri=row["source_uri"],
                driver_strategy=row["driver_strategy"],
            ),
            aggregate_id=f"image:{row['slug']}",
            event_id=derived_event_id(activation_event_key(row["slug"], row["digest_sha256"]), "activated"),
        )
        activated.append(row["slug"])
    for seed in seeds:
        locked = await uow.repos.images.lock(seed.slug)
        if locked is not None and locked["kind"] == "slice" and locked["status"] in ("active", "published"):
            if not _meta(locked).get("artifact_ref"):
                await prewarm_everywhere(uow, locked["slug"], cause=f"seed:{uuid.uuid4()}")
            if locked["status"] == "published" and await evaluate_gate(uow, locked["slug"]):
                activated.append(locked["slug"])
    return activated
