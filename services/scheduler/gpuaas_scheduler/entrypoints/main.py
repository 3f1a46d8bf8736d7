"""`gpuaas-scheduler`: inventory, placement and claims, and the admin HTTP API."""

from __future__ import annotations

import asyncio

from gpuaas_common.fleet import Fleet
from gpuaas_common.logging import get_logger
from gpuaas_common.periodic import every
from gpuaas_common.retention import HostRows
from gpuaas_common.runtime import ServiceRuntime, run_service
from gpuaas_common.startup import StartupFailed

from ..adapters.allocator_client import AllocatorClient
from ..adapters.inventory import refresh_nodes, seed_from_fleet
from ..adapters.metrics import inventory_reading
from ..adapters.repository import scheduler_repositories
from ..service_layer.claim_audit import AuditPolicy, audit_claims
from ..service_layer.handlers import Scheduler, allocation_first_lock, evidence_handlers, handlers, mirrored
from ..service_layer.host_walk import HostWalker, WalkPolicy
from ..service_layer.host_walk import sweep as walk_sweep
from ..service_layer.placement import PlacementPolicy, with_fleet_shape
from ..service_layer.steering import SteeringPolicy, sweep
from ..settings import SchedulerSettings
from .admin_http import admin_api

log = get_logger(__name__)

# The durables fed by hosts (gpuaas.node.<id>.report.*): each node's messages have a budget (bus_budget).
HOST_FED = frozenset(
    {"scheduler-node-parity", "scheduler-node-topology", "scheduler-node-drift", "scheduler-node-slot-wipes"}
)
# Tables a host's messages grow: pruned by age and capped per host (retention.py). The drift itself (node_drift)
# is state, kept; each report is history.
HOST_ROWS = (HostRows("node_drift_reports", "checked_at", "t.node_id"),)


def build_register(settings: SchedulerSettings):
    async def register(rt: ServiceRuntime) -> None:
        assert rt.bus is not None and rt.pool is not None
        rt.host_rows.extend(HOST_ROWS)
        # `uow.repos` of every unit of work the bus opens: the handlers reach nodes, slots and claims through it.
        rt.bus.repositories = scheduler_repositories
        await _seed(rt, settings)
        walks = walk_policy(settings)
        walker = HostWalker(walks)
        scheduler = Scheduler(
            await _placement_policy(rt, settings), walker, drift_reports_kept=settings.host_rows_per_node
        )
        _subscribe(rt, scheduler, walker)
        _spawn_sweeps(rt, settings, walks)
        await _start_admin_api(rt, settings)

    return register


async def _seed(rt: ServiceRuntime, settings: SchedulerSettings) -> None:
    assert rt.bus is not None
    fleet = _inventory(settings.inventory_file) if settings.inventory_file else None
    async with rt.bus.unit_of_work() as uow:
        if fleet is not None:
            added = await seed_from_fleet(uow.conn, fleet)
            log.info("inventory_seeded", slots_added=added, nodes=len(fleet.nodes))
        # The capacity summary only orders candidates, but keep it honest after any restart.
        await refresh_nodes(uow.conn)
        await uow.commit()


async def _placement_policy(rt: ServiceRuntime, settings: SchedulerSettings) -> PlacementPolicy:
    assert rt.pool is not None
    policy = PlacementPolicy(
        clean_node_watermark=settings.clean_node_watermark,
        default_tenant_gpu_quota=settings.tenant_gpu_quota,
        candidate_page=settings.candidate_page,
        allow_emulated_slots=settings.allow_emulated_slots,
    )
    async with rt.pool.acquire() as conn:
        return await with_fleet_shape(conn, policy)


def walk_policy(settings: SchedulerSettings) -> WalkPolicy:
    return WalkPolicy(
        slice_host_profile=settings.slice_host_profile,
        maas_site=settings.maas_site,
        allow_emulated=settings.allow_emulated_slots,
        steering=steering_policy(settings),
    )


def _subscribe(rt: ServiceRuntime, scheduler: Scheduler, walker: HostWalker) -> None:
    assert rt.bus is not None
    rt.bus.subscribe(
        rt.consumer_spec("scheduler-allocation-events"),
        handlers(scheduler),
        first_lock=allocation_first_lock,
        wanted=mirrored,
    )
    # Readiness evidence: parity, advisory topology, image cache state. Each is its own durable so a
    # backlog on one (e.g. a fleet-wide prewarm) never delays the others or placement.
    for durable, handler_map in evidence_handlers(scheduler).items():
        budget = rt.host_budget(durable) if durable in HOST_FED else None
        rt.bus.subscribe(rt.consumer_spec(durable), handler_map, host_budget=budget)
    # The results of the host walks' slice-host deploys (every other deploy's result is left to the allocator).
    rt.bus.subscribe(rt.consumer_spec("scheduler-maas-deploys"), {"maas.deploy_result": walker.on_deploy_result})


def _spawn_sweeps(rt: ServiceRuntime, settings: SchedulerSettings, walks: WalkPolicy) -> None:
    """The claim audit, the steering sweep and the host walks' sweep, and the inventory's readings."""
    assert rt.bus is not None and rt.pool is not None and rt.nc is not None
    # Claims whose allocation ended (or never existed) at the allocator while this database lost the news.
    allocator = AllocatorClient(rt.nc, settings.claim_audit_answer_timeout_s)
    audit_policy = AuditPolicy(
        every_s=settings.claim_audit_every_s,
        min_age_s=settings.claim_audit_min_age_s,
        orphan_after_s=settings.claim_orphan_after_s,
    )
    bus = rt.bus
    rt.spawn(
        every(
            settings.claim_audit_sweep_interval_s,
            lambda: audit_claims(bus.unit_of_work, allocator.states, audit_policy),
            "claim_audit",
        ),
        "claim-audit",
    )
    # /metrics: slots by status, hosts by mode, live claims, evidence ages (adapters/metrics.py).
    rt.add_reading("inventory", inventory_reading(rt.pool))
    steering = steering_policy(settings)
    rt.spawn(
        every(settings.steering_sweep_interval_s, lambda: sweep(bus.unit_of_work, steering), "steering"),
        "steering",
    )
    rt.spawn(
        every(settings.host_walk_sweep_interval_s, lambda: walk_sweep(bus.unit_of_work, walks), "host_walk"),
        "host-walk",
    )


async def _start_admin_api(rt: ServiceRuntime, settings: SchedulerSettings) -> None:
    assert rt.pool is not None
    if settings.admin_token is None:
        log.warning(
            "admin_api_disabled", why="GPUAAS_ADMIN_TOKEN is not set: the admin API never listens without a token"
        )
        return
    api = admin_api(
        rt.pool,
        settings.admin_token,
        console_token=settings.console_token,
        allow_emulated_slots=settings.allow_emulated_slots,
        steering=steering_policy(settings),
    )
    rt.ready_info["admin_port"] = await api.start(settings.admin_host, settings.admin_port)

    async def keep() -> None:
        try:
            await asyncio.Event().wait()
        finally:
            await api.stop()

    rt.spawn(keep(), "admin-api")


def steering_policy(settings: SchedulerSettings) -> SteeringPolicy:
    return SteeringPolicy(
        task_deadline_s=settings.node_task_deadline_s,
        commission_deadline_s=settings.commission_deadline_s,
        maas_site=settings.maas_site,
        commission_scripts=tuple(settings.commission_scripts),
        parity_interval_s=settings.parity_interval_s or None,
    )


def _inventory(path: str) -> Fleet:
    try:
        return Fleet.load(path)
    except (OSError, ValueError) as exc:  # a missing or malformed file is a wrong setting, not a crash
        raise StartupFailed(
            "invalid_settings", f"GPUAAS_INVENTORY_FILE {path}: {exc}"[:500], setting="GPUAAS_INVENTORY_FILE"
        ) from None


def main() -> None:
    run_service(
        "scheduler",
        SchedulerSettings,
        build_register,
        schema="scheduler",
        migrations_package="gpuaas_scheduler.migrations",
    )


if __name__ == "__main__":
    main()
