"""`gpuaas-allocator`: the allocation process manager."""

from __future__ import annotations

import asyncio

import asyncpg

from gpuaas_common.logging import get_logger
from gpuaas_common.runtime import ServiceRuntime, run_service

from ..adapters.repository import AllocationRepository, count_images
from ..service_layer.deadlines import expire_overdue_tasks
from ..service_layer.handlers import Allocator, handlers_by_consumer
from ..settings import AllocatorSettings

log = get_logger(__name__)


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

        # The control plane owns node-task deadlines: a silent host fails its allocation (see deadlines.py).
        bus = rt.bus
        rt.spawn(
            _every(settings.task_deadline_sweep_interval_s, lambda: expire_overdue_tasks(bus.unit_of_work, settings)),
            "task-deadlines",
        )

    return register


async def _poll(fn) -> None:
    while True:
        try:
            await fn()
        except (OSError, asyncpg.PostgresError):
            pass  # readiness simply stays false while the database is away
        await asyncio.sleep(0.5)


async def _every(interval_s: float, fn) -> None:
    while True:
        try:
            await fn()
        except (OSError, asyncpg.PostgresError) as exc:
            log.warning("task_deadline_sweep_failed", error=str(exc)[:300])
        await asyncio.sleep(interval_s)


def main() -> None:
    run_service(
        "allocator",
        AllocatorSettings,
        build_register,
        schema="allocator",
        migrations_package="gpuaas_allocator.migrations",
    )


if __name__ == "__main__":
    main()
