"""`gpuaas-image-pipeline`: the image catalog, builds and publishing, node cache prewarm and the
activation gate, and the admin HTTP API."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from gpuaas_common.bus import HandlerContext
from gpuaas_common.logging import get_logger
from gpuaas_common.runtime import ServiceRuntime, run_service
from gpuaas_common.startup import StartupFailed
from gpuaas_common.unit_of_work import UnitOfWork

from ..adapters.metrics import catalog_reading
from ..adapters.repository import image_pipeline_repositories
from ..domain.catalog import SeedImage
from ..service_layer import catalog, host_images, tenancy
from ..service_layer.seeding import apply_seed
from ..settings import ImagePipelineSettings
from .admin_http import AdminApi
from .build_runner import build_runner

log = get_logger(__name__)

# The durables fed by hosts (gpuaas.node.<id>.report.*): each node's messages have a budget (bus_budget).
HOST_FED = frozenset({"image-pipeline-enrolments", "image-pipeline-cache-reports"})


def build_register(settings: ImagePipelineSettings):
    async def register(rt: ServiceRuntime) -> None:
        assert rt.pool is not None and rt.bus is not None
        seeds = await asyncio.to_thread(_seeds, settings.image_seed_file) if settings.image_seed_file else []
        rt.bus.repositories = image_pipeline_repositories
        async with UnitOfWork(
            rt.pool, "image_pipeline", "image-pipeline", image_pipeline_repositories, correlation_id="image-seed"
        ) as uow:
            activated = await apply_seed(uow, seeds)
            await uow.commit()
        log.info("catalog_seeded", active=activated)

        runner = build_runner(rt.pool, rt.bus, settings)
        interrupted = await runner.recover()
        if interrupted:
            log.warning("builds_interrupted", count=interrupted)
        rt.spawn(runner.watch(), "build-recovery")
        # /metrics: node caches by state, the catalog and builds by status (adapters/metrics.py).
        rt.add_reading("image-catalog", catalog_reading(rt.pool))

        async def on_enrolled(ctx: HandlerContext) -> None:
            sent = await catalog.on_enrolled(ctx.uow, ctx.payload, ctx.envelope.event_id)
            log.info("slice_host_known", node_id=ctx.payload.node_id, kind=ctx.payload.kind, prewarm_tasks=sent)

        async def on_cache_reported(ctx: HandlerContext) -> None:
            await catalog.on_cache_reported(ctx.uow, ctx.payload)

        # Host-fed (HOST_FED): each node's messages have a budget (bus_budget).
        rt.bus.subscribe(
            rt.consumer_spec("image-pipeline-enrolments"),
            {"node.enrolled": on_enrolled},
            host_budget=rt.host_budget("image-pipeline-enrolments"),
        )
        rt.bus.subscribe(
            rt.consumer_spec("image-pipeline-cache-reports"),
            {"node.image_cache_reported": on_cache_reported},
            host_budget=rt.host_budget("image-pipeline-cache-reports"),
        )

        async def on_upload_result(ctx: HandlerContext) -> None:
            await host_images.on_upload_result(ctx.uow, ctx.payload)

        async def on_profile_result(ctx: HandlerContext) -> None:
            await host_images.on_profile_image_result(ctx.uow, ctx.payload)

        rt.bus.subscribe(
            rt.consumer_spec("image-pipeline-maas-uploads"), {"maas.image_upload_result": on_upload_result}
        )
        rt.bus.subscribe(
            rt.consumer_spec("image-pipeline-maas-profiles"), {"maas.profile_image_set_result": on_profile_result}
        )

        # Baremetal tenancies (domain/tenancy.py): a tenant's host is refused as a slice host (catalog.on_enrolled).
        async def on_deploy(ctx: HandlerContext) -> None:
            await tenancy.on_deploy_requested(ctx.uow, ctx.payload, ctx.envelope)

        async def on_machine_released(ctx: HandlerContext) -> None:
            await tenancy.on_machine_released(ctx.uow, ctx.payload)

        rt.bus.subscribe(rt.consumer_spec("image-pipeline-tenancies"), {"maas.deploy_requested": on_deploy})
        rt.bus.subscribe(
            rt.consumer_spec("image-pipeline-machine-releases"), {"maas.release_result": on_machine_released}
        )

        # A retired or baremetal host leaves the activation gate (catalog.on_host_mode_changed).
        async def on_host_mode_changed(ctx: HandlerContext) -> None:
            await catalog.on_host_mode_changed(ctx.uow, ctx.payload)

        rt.bus.subscribe(
            rt.consumer_spec("image-pipeline-host-modes"), {"scheduler.host_mode_changed": on_host_mode_changed}
        )

        if settings.admin_token is None:
            log.warning(
                "admin_api_disabled", why="GPUAAS_ADMIN_TOKEN is not set: the admin API never listens without a token"
            )
            return
        api = AdminApi(rt.pool, runner, settings)
        rt.ready_info["admin_port"] = await api.start()
        rt.health.checks["admin_api"] = lambda: api.port is not None

    return register


def _seeds(path: str) -> list[SeedImage]:
    try:
        return [SeedImage.model_validate(s) for s in json.loads(Path(path).read_text())]
    except (OSError, ValueError, TypeError) as exc:  # a missing or malformed file is a wrong setting, not a crash
        raise StartupFailed(
            "invalid_settings", f"GPUAAS_IMAGE_SEED_FILE {path}: {exc}"[:500], setting="GPUAAS_IMAGE_SEED_FILE"
        ) from None


def main() -> None:
    run_service(
        "image-pipeline",
        ImagePipelineSettings,
        build_register,
        schema="image_pipeline",
        migrations_package="gpuaas_image_pipeline.migrations",
    )


if __name__ == "__main__":
    main()
