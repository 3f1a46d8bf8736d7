"""The start-up and shut-down sequence every service process shares.

Order matters: migrations before subscribers (handlers need their tables), provisioning before the
broker binds (consumers must exist with our config, see jetstream.py), readiness last.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
from collections.abc import Awaitable, Callable
from dataclasses import replace
from pathlib import Path

import asyncpg
from faststream.nats import NatsBroker
from nats.aio.client import Client as NatsClient
from nats.js import JetStreamContext

from .bus import Bus
from .db import create_pool
from .health import HealthServer
from .jetstream import CONSUMER_BY_NAME, ConsumerSpec, ensure_consumers, provision
from .logging import configure_logging, get_logger
from .migrations import apply_migrations
from .natsconn import NatsIdentity
from .outbox import OutboxRelay
from .retention import RetentionSweeper
from .settings import ServiceSettings

log = get_logger(__name__)


class ServiceRuntime:
    def __init__(
        self,
        name: str,
        settings: ServiceSettings,
        *,
        schema: str | None = None,
        migrations_package: str | None = None,
        connect_bus: bool = True,
    ) -> None:
        """`connect_bus=False` for a process whose NATS connections belong to others (the node agent
        connects once per host, each as that host's own user)."""
        self.name = name
        self.connect_bus = connect_bus
        self.identity = NatsIdentity.from_settings(settings)
        self.settings = settings
        self.schema = schema
        self.migrations_package = migrations_package
        self.health = HealthServer(name, settings.health_host, settings.health_port)
        self.pool: asyncpg.Pool | None = None
        self.nc: NatsClient | None = None
        self.js: JetStreamContext | None = None
        self.broker: NatsBroker | None = None
        self.bus: Bus | None = None
        self.relay: OutboxRelay | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._stop = asyncio.Event()
        # Called first on stop, e.g. to close connections a service opened itself.
        self.on_stop: list[Callable[[], Awaitable[None]]] = []
        # Extra fields for the ready file, e.g. a port a service's own HTTP server bound.
        self.ready_info: dict[str, object] = {}

    @property
    def dsn(self) -> str:
        return self.settings.database_url.get_secret_value()

    async def setup(self) -> None:
        configure_logging(self.name, self.settings.log_level)
        await self.health.start()
        if self.schema:
            self.pool = await create_pool(self.dsn, self.schema)
            async with self.pool.acquire() as conn:
                await apply_migrations(conn, self.schema, self.migrations_package)
            self.health.checks["database"] = lambda: self.pool is not None and not self.pool._closed  # type: ignore[attr-defined]
        if not self.connect_bus:
            return
        self.nc = await self.identity.connect(name=f"gpuaas-{self.name}")
        self.js = self.nc.jetstream()
        self.broker = NatsBroker(**self.identity.broker_kwargs(), max_reconnect_attempts=-1, reconnect_time_wait=0.5)
        self.bus = Bus(
            self.broker,
            self.js,
            service=self.name,
            schema=self.schema,
            pool=self.pool,
            retry_delays_s=self.settings.retry_delays_s,
            inbox_prefix=self.identity.inbox,
        )
        self.health.checks["nats"] = lambda: self.nc is not None and self.nc.is_connected

    def spawn(self, coro: Awaitable[None], name: str) -> None:
        task = asyncio.ensure_future(coro)
        task.set_name(name)
        task.add_done_callback(self._task_done)
        self._tasks.append(task)

    def _task_done(self, task: asyncio.Task[None]) -> None:
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            # A dead background loop is a dead service: exit so the supervisor restarts us.
            log.error("background_task_died", task=task.get_name(), error=repr(exc))
            self._stop.set()

    async def start(self) -> None:
        if not self.connect_bus:
            self.health.ready = True
            self.spawn(self._announce_ready(), "announce-ready")
            return
        assert self.broker and self.js and self.bus
        if self.settings.nats_creds:
            # An identity may create only its own durables; streams are provisioned by the admin
            # identity (the dev stack, compose's init step), which may not have happened yet.
            await ensure_consumers(self.js, self.bus.consumers)
        else:
            await provision(self.js, self.bus.consumers)  # an open dev server: we provision everything
        await self.broker.start()
        if self.schema:
            self.relay = OutboxRelay(
                self.dsn,
                self.schema,
                self.js,
                batch_size=self.settings.relay_batch_size,
                poll_interval_s=self.settings.relay_poll_interval_s,
            )
            self.spawn(self.relay.run(), "outbox-relay")
            assert self.pool is not None
            self.spawn(
                RetentionSweeper(
                    self.pool,
                    self.schema,
                    inbox_retention_s=self.settings.inbox_retention_s,
                    idempotency_retention_s=self.settings.idempotency_retention_s,
                    interval_s=self.settings.retention_sweep_interval_s,
                    batch_size=self.settings.retention_batch_size,
                ).run(),
                "retention-sweep",
            )
        self.health.ready = True
        self.spawn(self._announce_ready(), "announce-ready")

    async def _announce_ready(self) -> None:
        # Health checks are plain callables over other components' state: nothing to wait on but a poll.
        while not all(check() for check in self.health.checks.values()):  # noqa: ASYNC110
            await asyncio.sleep(0.1)
        if self.settings.ready_file:
            path = Path(self.settings.ready_file)
            tmp = path.with_suffix(".tmp")
            info = {**self.ready_info, "service": self.name, "pid": os.getpid(), "health_port": self.health.port}
            tmp.write_text(json.dumps(info))
            tmp.replace(path)
        log.info("service_ready", health_port=self.health.port, **self.ready_info)

    def consumer_spec(self, durable: str) -> ConsumerSpec:
        """A declared consumer with this deployment's retry limits applied."""
        spec = CONSUMER_BY_NAME[durable]
        return replace(
            spec,
            max_deliver=self.settings.consumer_max_deliver,
            ack_wait_s=max(spec.ack_wait_s, self.settings.consumer_ack_wait_s),
        )

    async def stop(self) -> None:
        self.health.ready = False
        for hook in self.on_stop:
            await hook()
        if self.relay:
            self.relay.stop()
        if self.broker:
            await self.broker.stop()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.nc:
            await self.nc.drain()
        if self.pool:
            await self.pool.close()
        await self.health.stop()
        log.info("service_stopped")

    async def run(self, register: Callable[["ServiceRuntime"], Awaitable[None]]) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stop.set)
        await self.setup()
        await register(self)
        await self.start()
        await self._stop.wait()
        await self.stop()


def run_service(
    name: str,
    settings: ServiceSettings,
    register: Callable[[ServiceRuntime], Awaitable[None]],
    *,
    schema: str | None = None,
    migrations_package: str | None = None,
    connect_bus: bool = True,
) -> None:
    runtime = ServiceRuntime(
        name, settings, schema=schema, migrations_package=migrations_package, connect_bus=connect_bus
    )
    asyncio.run(runtime.run(register))
