"""`gpuaas-image-pipeline`: the image catalog."""

from __future__ import annotations

import json
from pathlib import Path

from gpuaas_common.logging import get_logger
from gpuaas_common.outbox import OutboxWriter
from gpuaas_common.runtime import ServiceRuntime, run_service

from ..domain.catalog import SeedImage
from ..service_layer.seeding import apply_seed
from ..settings import ImagePipelineSettings

log = get_logger(__name__)


def build_register(settings: ImagePipelineSettings):
    async def register(rt: ServiceRuntime) -> None:
        assert rt.pool is not None
        seeds = []
        if settings.image_seed_file:
            seeds = [SeedImage.model_validate(s) for s in json.loads(Path(settings.image_seed_file).read_text())]
        async with rt.pool.acquire() as conn, conn.transaction():
            writer = OutboxWriter(conn, "image_pipeline", "image-pipeline", correlation_id="image-seed")
            activated = await apply_seed(conn, writer, seeds)
        log.info("catalog_seeded", active=activated)

    return register


def main() -> None:
    settings = ImagePipelineSettings()
    run_service("image-pipeline", settings, build_register(settings), schema="image_pipeline",
                migrations_package="gpuaas_image_pipeline.migrations")


if __name__ == "__main__":
    main()
