"""`gpuaas-ops-view`: read models that follow the streams, and the ops API over them."""

from __future__ import annotations

import asyncio

import nats.errors

from gpuaas_common.bus import Bus
from gpuaas_common.bus_budget import HostBudget
from gpuaas_common.jetstream import FOLLOWERS
from gpuaas_common.logging import get_logger
from gpuaas_common.metrics import consumer_reading
from gpuaas_common.runtime import ServiceRuntime, run_service

from ..adapters.changes import Changes
from ..adapters.host_rows import HOST_ROWS
from ..adapters.metrics import dead_letters_reading, dlq_reading
from ..adapters.scheduler_admin import SchedulerAdmin
from ..settings import OpsViewSettings
from .admin_http import ops_api
from .follow import StreamFollower
from .web.pages import Console

log = get_logger(__name__)


def build_register(settings: OpsViewSettings):
    async def register(rt: ServiceRuntime) -> None:
        assert rt.nc is not None and rt.js is not None and rt.pool is not None
        # Tables a host's messages grow (node tasks, their phases, dead letters: adapters/host_rows.py): pruned by
        # age by the retention sweep, capped per host by each follower transaction that inserts into them.
        rt.host_rows.extend(HOST_ROWS)
        # Dead letters go out directly (no outbox): the follower publishes them before its commit.
        letters = Bus(rt.nc, rt.js, service="ops-view", schema=None, pool=None)

        def budget(stream: str, name: str) -> HostBudget | None:
            # Hosts' reports have a budget per node; hosts' dead letters (agents now send a count instead) none.
            if stream == "NODE_REPORTS":
                return rt.host_budget(name)
            return HostBudget.refusing(name) if stream == "DLQ" else None

        followers = [
            StreamFollower(
                rt.nc,
                rt.js,
                rt.pool,
                spec,
                name=name,
                dead_letters=letters,
                batch=settings.follow_batch,
                budget=budget(spec.stream, name),
                host_rows_per_node=settings.host_rows_per_node,
            )
            for spec in FOLLOWERS
            for name in (spec.durable.replace("ops-view", settings.follower_prefix, 1),)
        ]
        for follower in followers:
            rt.spawn(follower.run(), f"follow-{follower.stream}")
        js = rt.js
        # /metrics: the followers' lag, the DLQ stream's size, the model's dead letters by reason (adapters/metrics.py).
        rt.add_reading(
            "ops-view-followers", consumer_reading(js, lambda: ((f.stream, f.spec.durable) for f in followers))
        )
        rt.add_reading("dlq", dlq_reading(js))
        rt.add_reading("dead-letters", dead_letters_reading(rt.pool))

        async def consumer_state() -> dict[str, tuple[int, int] | None]:
            state: dict[str, tuple[int, int] | None] = {}
            for follower in followers:
                try:
                    info = await js.consumer_info(follower.stream, follower.spec.durable, timeout=2.0)
                    state[follower.stream] = (info.num_pending or 0, info.delivered.stream_seq or 0)
                except (nats.errors.Error, TimeoutError):
                    state[follower.stream] = None
            return state

        if settings.admin_token is None:
            log.warning("ops_api_disabled", why="GPUAAS_ADMIN_TOKEN is not set: the ops API never listens without one")
            return
        changes = Changes(rt.pool)
        rt.spawn(changes.run(), "console-changes")
        scheduler = SchedulerAdmin(settings.scheduler_admin_url, settings.scheduler_console_token)
        if not scheduler.configured:
            log.warning(
                "console_read_only",
                why="GPUAAS_SCHEDULER_ADMIN_URL/GPUAAS_SCHEDULER_CONSOLE_TOKEN unset: the console cannot drain",
            )
        if settings.console_login_secret is None:
            log.warning("console_closed", why="GPUAAS_CONSOLE_LOGIN_SECRET unset: no login link signs anyone in")
        api = ops_api(
            rt.pool,
            settings.admin_token,
            consumer_state,
            Console(rt.pool, changes, scheduler),
            billing_token=settings.billing_token,
            login_secret=settings.console_login_secret,
        )
        rt.ready_info["admin_port"] = await api.start(settings.admin_host, settings.admin_port)

        async def keep() -> None:
            try:
                await asyncio.Event().wait()
            finally:
                await api.stop()
                await scheduler.close()

        rt.spawn(keep(), "ops-api")

    return register


def main() -> None:
    run_service(
        "ops-view", OpsViewSettings, build_register, schema="ops_view", migrations_package="gpuaas_ops_view.migrations"
    )


if __name__ == "__main__":
    main()
