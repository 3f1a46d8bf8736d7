"""`gpuaas-allocator`: the allocation process manager."""

from __future__ import annotations

import asyncio

import asyncpg

from gpuaas_common.runtime import ServiceRuntime, run_service

from ..adapters.repository import AllocationRepository, count_images
from ..service_layer.handlers import Allocator, handlers_by_consumer
from ..settings import AllocatorSettings


def build_register(settings: AllocatorSettings):
    async def register(rt: ServiceRuntime) -> None:
        assert rt.bus is not None and rt.pool is not None
        rt.bus.repositories = AllocationRepository
        allocator = Allocator(settings)
        for durable, handlers in handlers_by_consumer(allocator).items():
            rt.bus.subscribe(rt.consumer_spec(durable), handlers)
        known = {"count": 0}

        async def refresh() -> None:
            known["count"] = await count_images(rt.pool)  # type: ignore[arg-type]

        # Ready only once the image catalog has reached us: without it every request is rejected.
        rt.health.checks["images_known"] = lambda: known["count"] > 0
        rt.spawn(_poll(refresh), "image-readiness")

    return register


async def _poll(fn) -> None:
    while True:
        try:
            await fn()
        except (OSError, asyncpg.PostgresError):
            pass  # readiness simply stays false while the database is away
        await asyncio.sleep(0.5)


def main() -> None:
    settings = AllocatorSettings()
    run_service(
        "allocator",
        settings,
        build_register(settings),
        schema="allocator",
        migrations_package="gpuaas_allocator.migrations",
    )


if __name__ == "__main__":
    main()
