"""Apply seed data to the catalog without ever reverting what was already materialised."""

from __future__ import annotations

import json

import asyncpg

from gpuaas_common.contract import derived_event_id
from gpuaas_common.contract import messages as m
from gpuaas_common.outbox import OutboxWriter

from ..domain.catalog import SeedImage, activation_event_key


async def apply_seed(conn: asyncpg.Connection, writer: OutboxWriter, seeds: list[SeedImage]) -> list[str]:
    activated = []
    for seed in seeds:
        # ON CONFLICT DO NOTHING: an existing row keeps its digest and status, whatever the seed says.
        await conn.execute(
            "INSERT INTO os_images (slug, kind, status, driver_strategy, compatible_sku, source_uri, digest_sha256, metadata) "
            "VALUES ($1, $2, 'active', $3, $4, $5, $6, $7) ON CONFLICT (slug) DO NOTHING",
            seed.slug, seed.kind, seed.driver_strategy, seed.sku, seed.source_uri, seed.digest_sha256,
            json.dumps({"image_path": seed.image_path}),
        )
    rows = await conn.fetch("SELECT * FROM os_images WHERE status = 'active' ORDER BY slug")
    for row in rows:
        meta = json.loads(row["metadata"]) if isinstance(row["metadata"], str) else row["metadata"]
        await writer.add(
            "image.activated",
            m.ImageActivated(slug=row["slug"], kind=row["kind"], sku=row["compatible_sku"],
                             digest_sha256=row["digest_sha256"], image_path=meta["image_path"],
                             source_uri=row["source_uri"]),
            aggregate_id=f"image:{row['slug']}",
            event_id=derived_event_id(activation_event_key(row["slug"], row["digest_sha256"]), "activated"),
        )
        activated.append(row["slug"])
    return activated
