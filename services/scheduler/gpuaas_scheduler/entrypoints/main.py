"""`gpuaas-scheduler`: inventory, placement and claims."""

from __future__ import annotations

from gpuaas_common.fleet import Fleet
from gpuaas_common.logging import get_logger
from gpuaas_common.runtime import ServiceRuntime, run_service

from ..adapters.inventory import seed_from_fleet
from ..service_layer.handlers import Scheduler, handlers
from ..settings import SchedulerSettings

log = get_logger(__name__)


def build_register(settings: SchedulerSettings):
    async def register(rt: ServiceRuntime) -> None:
        assert rt.bus is not None and rt.pool is not None
        if settings.inventory_file:
            fleet = Fleet.load(settings.inventory_file)
            async with rt.pool.acquire() as conn, conn.transaction():
                added = await seed_from_fleet(conn, fleet)
            log.info("inventory_seeded", slots_added=added, nodes=len(fleet.nodes))
        rt.bus.subscribe(rt.consumer_spec("scheduler-allocation-events"), handlers(Scheduler()))

    return register


def main() -> None:
    settings = SchedulerSettings()
    run_service("scheduler", settings, build_register(settings), schema="scheduler",
                migrations_package="gpuaas_scheduler.migrations")


if __name__ == "__main__":
    main()
