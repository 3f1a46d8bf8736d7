"""The start-up and shut-down sequence every service process shares.

Order matters: migrations before subscribers (handlers need their tables), provisioning before the
bus starts pulling (consumers must exist with our config, see jetstream.py), readiness last.

A start-up that cannot finish ends the process with one `startup_failed` JSON line and the exit code of
its reason (startup.py): settings are read inside `run_service` for that, and Postgres and NATS are
waited for at most `startup_timeout_s`.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
import urllib.parse
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

import asyncpg
import nats.errors
import uvloop
from nats.aio.client import Client as NatsClient
from nats.js import JetStreamContext

from .bus import Bus
from .bus_budget import HostBudget
from .creds_renewal import CredsRenewal
from .db import BackendPids, create_pool
from .health import HealthServer
from .jetstream import (
    CONSUMER_BY_NAME,
    ConsumerSpec,
    DurableNotAsProvisioned,
    deployed,
    ensure_consumers,
    provision,
)
from .logging import configure_logging, get_logger
from .metrics import READINGS, Reading, consumer_reading, outbox_reading, record_build
from .migrations import apply_migrations
from .natsconn import NatsIdentity
from .outbox import OutboxRelay
from .pg_roles import dsn_without_password
from .profiling import profiled
from .retention import HostRows, RetentionSweeper
from .settings import ServiceSettings
from .startup import StartupFailed, classify, redact

log = get_logger(__name__)

S = TypeVar("S", bound=ServiceSettings)
Register = Callable[["ServiceRuntime"], Awaitable[None]]


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
        # The pool's backends: the only senders whose NOTIFYs the outbox relay takes rows from.
        self.writers = BackendPids()
        self.nc: NatsClient | None = None
        self.js: JetStreamContext | None = None
        self.bus: Bus | None = None
        self.relay: OutboxRelay | None = None
        # Switches the connection to renewed credentials when its creds file changes (creds_renewal).
        self.renewal: CredsRenewal | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._stop = asyncio.Event()
        # Called first on stop, e.g. to close connections a service opened itself.
        self.on_stop: list[Callable[[], Awaitable[None]]] = []
        # Extra fields for the ready file, e.g. a port a service's own HTTP server bound.
        self.ready_info: dict[str, object] = {}
        self._failed = False  # a background task died: the process exits non-zero
        # What /metrics reads at each scrape, by name (`add_reading`); removed again at stop.
        self._readings: dict[str, Reading] = {}
        # Tables a host's messages grow, pruned by age and capped per host by the retention sweep (retention.py);
        # a service names its own in its register.
        self.host_rows: list[HostRows] = []

    @property
    def dsn(self) -> str:
        return self.settings.database_url.get_secret_value()

    def add_reading(self, name: str, reading: Reading) -> None:
        """Gauges /metrics reads from this service's own state when it is scraped (`gpuaas_common.metrics`)."""
        self._readings[name] = reading
        READINGS.add(name, reading)

    async def setup(self) -> None:
        configure_logging(self.name, self.settings.log_level)
        record_build(self.name)
        deadline = time.monotonic() + self.settings.startup_timeout_s
        try:
            await self.health.start()
        except OSError as exc:
            raise StartupFailed(
                "port_unavailable",
                f"health server on {self.settings.health_host}:{self.settings.health_port}: {exc.strerror or exc}",
                setting="GPUAAS_HEALTH_PORT",
            ) from None
        if self.schema:
            self.pool = await self._connect_database(self.schema, deadline)
            async with self.pool.acquire() as conn:
                await apply_migrations(conn, self.schema, self.migrations_package)
            self.health.checks["database"] = lambda: self.pool is not None and not self.pool._closed  # type: ignore[attr-defined]
        if not self.connect_bus:
            return
        self.nc = await self._connect_nats(deadline)
        self.js = self.nc.jetstream()
        self.bus = Bus(
            self.nc,
            self.js,
            service=self.name,
            schema=self.schema,
            pool=self.pool,
            retry_delays_s=self.settings.retry_delays_s,
            default_concurrency=self.settings.consumer_concurrency,
        )
        # A credential switch (gate closed) reconnects for a few milliseconds: not a reason to be unready.
        bus = self.bus
        self.health.checks["nats"] = lambda: self.nc is not None and (self.nc.is_connected or not bus.gate.is_open)

    async def _connect_database(self, schema: str, deadline: float) -> asyncpg.Pool:
        """The pool, once Postgres answers; refused credentials and bad DSNs fail at once."""
        password = urllib.parse.urlsplit(self.dsn).password
        where = {"database": dsn_without_password(self.dsn)}
        delay = 0.1
        while True:
            try:
                return await asyncio.wait_for(
                    create_pool(self.dsn, schema, writers=self.writers), timeout=max(0.1, deadline - time.monotonic())
                )
            except asyncpg.InvalidAuthorizationSpecificationError as exc:  # wrong role or password
                raise StartupFailed("database_auth_refused", redact(str(exc), password), **where) from None
            except (ValueError, asyncpg.InterfaceError) as exc:  # asyncpg cannot even parse the DSN
                raise StartupFailed(
                    "invalid_settings", redact(str(exc), password, self.dsn), setting="GPUAAS_DATABASE_URL"
                ) from None
            except (OSError, TimeoutError, asyncpg.CannotConnectNowError, asyncpg.TooManyConnectionsError) as exc:
                last = redact(str(exc) or type(exc).__name__, password)
            except asyncpg.PostgresError as exc:  # e.g. the database does not exist: waiting will not help
                raise StartupFailed("database_unreachable", redact(str(exc), password), **where) from None
            if time.monotonic() + delay >= deadline:
                raise StartupFailed(
                    "database_unreachable",
                    f"no answer within {self.settings.startup_timeout_s:g}s: {last}",
                    **where,
                )
            await asyncio.sleep(delay)  # back-off between connection attempts
            delay = min(delay * 2, 2.0)

    async def _connect_nats(self, deadline: float) -> NatsClient:
        """Our connection, once a server accepts it. nats-py retries the first connection by itself (and
        re-reads the creds file each time); the deadline is ours."""
        try:
            return await asyncio.wait_for(
                self.identity.connect(name=f"gpuaas-{self.name}"), timeout=max(0.1, deadline - time.monotonic())
            )
        except TimeoutError:
            refusal = self.identity.last_refusal
            last = refusal or self.identity.last_error or "no answer"
            reason = "nats_auth_refused" if refusal else "nats_unreachable"
            raise StartupFailed(
                reason,
                f"not connected within {self.settings.startup_timeout_s:g}s: {last}",
                nats_url=self.settings.nats_url,
                identity=self.identity.name,
            ) from None

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
            self._failed = True
            self._stop.set()

    async def start(self) -> None:
        if not self.connect_bus:
            self.health.ready = True
            self.spawn(self._announce_ready(), "announce-ready")
            return
        assert self.js and self.bus
        try:
            if self.settings.nats_creds:
                # Streams and durables are provisioned by the admin identity (the dev stack, compose's init step),
                # which may not have happened yet; an identity only binds to its own durables.
                await ensure_consumers(self.js, self.bus.consumers, create=False)
            else:
                await provision(self.js, self.bus.consumers)  # an open dev server: we provision everything
            await self.bus.start(on_loop_done=self._task_done, check_durables=False)
            bus = self.bus
            if bus.consumers:
                durables = lambda: ((c.stream, c.durable) for c in bus.consumers)  # noqa: E731
                self.add_reading(f"{self.name}-consumers", consumer_reading(self.js, durables))
        except (nats.errors.Error, OSError, TimeoutError, DurableNotAsProvisioned) as exc:
            raise StartupFailed(
                "nats_setup_failed",
                f"consumers or streams: {type(exc).__name__}: {exc}"[:500],
                identity=self.identity.name,
            ) from None
        if self.schema:
            self.relay = OutboxRelay(
                self.dsn,
                self.schema,
                self.js,
                batch_size=self.settings.relay_batch_size,
                poll_interval_s=self.settings.relay_poll_interval_s,
                writers=self.writers,
                gate=self.bus.gate,
            )
            self.spawn(self.relay.run(), "outbox-relay")
            self.add_reading(f"{self.schema}-outbox", outbox_reading(self.pool, self.schema))
            assert self.pool is not None
            self.spawn(
                RetentionSweeper(
                    self.pool,
                    self.schema,
                    inbox_retention_s=self.settings.inbox_retention_s,
                    idempotency_retention_s=self.settings.idempotency_retention_s,
                    interval_s=self.settings.retention_sweep_interval_s,
                    batch_size=self.settings.retention_batch_size,
                    host_rows=self.host_rows,
                    host_rows_retention_s=self.settings.host_rows_retention_s,
                    host_rows_per_node=self.settings.host_rows_per_node,
                ).run(),
                "retention-sweep",
            )
        if self.identity.creds_file and self.nc is not None:
            self.renewal = CredsRenewal(self.identity, self.nc, self.bus.gate, name=f"gpuaas-{self.name}")
            self.spawn(self.renewal.run(), "creds-renewal")
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
        loop = type(asyncio.get_running_loop())
        log.info("service_ready", health_port=self.health.port, event_loop=loop.__module__, **self.ready_info)

    def host_budget(self, consumer: str) -> HostBudget:
        """The per-node budget of a host-fed consumer (`bus_budget`), from this deployment's settings: its rate,
        and the inbox rows each node's messages may leave (`GPUAAS_HOST_ROWS_PER_NODE`, as for its other rows)."""
        return HostBudget(
            consumer,
            messages_per_min=self.settings.host_budget_messages_per_min,
            bytes_per_min=self.settings.host_budget_bytes_per_min,
            inbox_rows_per_node=self.settings.host_rows_per_node,
        )

    def consumer_spec(self, durable: str) -> ConsumerSpec:
        """A declared consumer with this deployment's retry limits applied (not to a durable the admin
        provisions: it has the declared limits, and the service binds to it as it is)."""
        return deployed(
            CONSUMER_BY_NAME[durable], self.settings.consumer_max_deliver, self.settings.consumer_ack_wait_s
        )

    def _drop_readings(self) -> None:
        for name, reading in self._readings.items():
            READINGS.remove(name, reading)
        self._readings.clear()

    async def stop(self) -> None:
        self.health.ready = False
        self._drop_readings()
        for hook in self.on_stop:
            await hook()
        if self.relay:
            self.relay.stop()
        if self.bus:
            await self.bus.stop()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.nc:
            await self.nc.drain()
        if self.pool:
            await self.pool.close()
        await self.health.stop()
        log.info("service_stopped")

    async def _abandon(self) -> None:
        """Release what a failed start-up holds; whatever fails here is not the news."""
        try:
            await asyncio.wait_for(self._release(), timeout=5.0)
        except Exception:  # noqa: BLE001, S110 - the start-up failure is already logged
            pass

    async def _release(self) -> None:
        self._drop_readings()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.bus:
            await self.bus.stop(grace_s=0.0)
        if self.nc and not self.nc.is_closed:
            await self.nc.close()
        if self.pool:
            self.pool.terminate()
        await self.health.stop()

    async def run(self, register: Register) -> int:
        """Start, serve until SIGTERM/SIGINT, stop; the process's exit code."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stop.set)
        try:
            await self.setup()
            await register(self)
            await self.start()
        except Exception as exc:
            failure = classify(exc)
            await self._abandon()
            log.error("startup_failed", **failure.log_fields())  # the last line: what the operator reads
            return failure.exit_code
        await self._stop.wait()
        await self.stop()
        return EXIT_SERVICE_FAILED if self._failed else 0


# A background loop died after start-up (its `background_task_died` line says which).
EXIT_SERVICE_FAILED = 70


def run_service(
    name: str,
    load_settings: Callable[[], S],
    build_register: Callable[[S], Register],
    *,
    schema: str | None = None,
    migrations_package: str | None = None,
    connect_bus: bool = True,
) -> None:
    """The whole life of a service process. Settings are read here, not by the caller, so that a bad
    variable is a `startup_failed` line (reason invalid_settings) like every other start-up failure."""
    # Until the settings are read, the level comes from the environment as given (if it is a level).
    level = os.environ.get("GPUAAS_LOG_LEVEL", "INFO").upper()
    configure_logging(name, level if level in ("DEBUG", "INFO", "WARNING", "ERROR") else "INFO")
    try:
        settings = load_settings()
        register = build_register(settings)
    except Exception as exc:
        failure = classify(exc)
        log.error("startup_failed", **failure.log_fields())
        sys.exit(failure.exit_code)
    runtime = ServiceRuntime(
        name, settings, schema=schema, migrations_package=migrations_package, connect_bus=connect_bus
    )
    run = uvloop.run if settings.event_loop == "uvloop" else asyncio.run
    code = profiled(name, lambda: run(runtime.run(register)))
    if code:
        sys.exit(code)
