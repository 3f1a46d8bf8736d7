"""One host's own connection to the bus, as that host's own NATS user.

A real agent has exactly one; the simulated fleet runs one per simulated host in one process, so the
simulation is held to the same server-enforced permissions as a real fleet: fetch and ack its own
task durable, publish its own reports, nothing else. It never creates streams or consumers: its
durable is provisioned when ops onboard the host.
"""

from __future__ import annotations

import asyncio

from nats.aio.client import Client as NatsClient

from gpuaas_common.bus import Bus
from gpuaas_common.bus_dispatch import HeldDeadLetters
from gpuaas_common.creds_renewal import CredsRenewal
from gpuaas_common.identity.permissions import HOST_JS_API
from gpuaas_common.logging import get_logger
from gpuaas_common.natsconn import NatsIdentity

log = get_logger(__name__)


class HostLink:
    def __init__(self, node_id: str, identity: NatsIdentity, *, retry_delays_s: tuple[float, ...]) -> None:
        self.node_id = node_id
        self.identity = identity
        self.retry_delays_s = retry_delays_s
        self.nc: NatsClient | None = None
        self.bus: Bus | None = None
        # The host's creds file, rewritten by whoever renews host users, is switched to without a gap.
        self.renewal: CredsRenewal | None = None
        self._renewal_task: asyncio.Task[None] | None = None

    async def open(self, *, retry_forever: bool = True) -> Bus:
        self.nc = await self.identity.connect(name=f"gpuaas-node-agent-{self.node_id}", retry_forever=retry_forever)
        # With creds the host is a user of the HOSTS account, which imports its durable's API under its own
        # prefix (identity.permissions.HOST_JS_API); an open dev server has one account and the usual prefix.
        js = self.nc.jetstream(prefix=HOST_JS_API) if self.identity.creds_file else self.nc.jetstream()
        self.bus = Bus(
            self.nc,
            js,
            service="node-agent",
            schema=None,
            pool=None,
            retry_delays_s=self.retry_delays_s,
        )
        # Off the DLQ path: what the agent cannot handle is logged here and counted in its drift reports.
        self.bus.held_dead_letters = HeldDeadLetters()
        if self.identity.creds_file:
            name = f"gpuaas-node-agent-{self.node_id}"
            self.renewal = CredsRenewal(self.identity, self.nc, self.bus.gate, name=name)
            self._renewal_task = asyncio.create_task(self.renewal.run(), name=f"creds-renewal-{self.node_id}")
        return self.bus

    async def start(self) -> None:
        assert self.bus is not None
        await self.bus.start()

    @property
    def connected(self) -> bool:
        return self.nc is not None and self.nc.is_connected

    async def close(self) -> None:
        if self._renewal_task is not None:
            self._renewal_task.cancel()
            await asyncio.gather(self._renewal_task, return_exceptions=True)
        if self.bus is not None:
            await self.bus.stop()
        if self.nc is not None and not self.nc.is_closed:
            try:
                await self.nc.drain()
            except Exception as exc:  # a revoked or vanished connection cannot drain; it is closed anyway
                log.debug("host_link_close", node_id=self.node_id, error=repr(exc))
                await self.nc.close()
