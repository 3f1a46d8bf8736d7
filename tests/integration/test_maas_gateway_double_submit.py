"""Two gateway workers, two pending deploys on one machine: MAAS must receive one deploy, not two.

Both workers read the machine as free before either marks its operation `submitting` (a barrier in the
step between the two holds them there, so the interleaving is forced, not hoped for). Only the
database can then keep the second call back: with migration 004's unique index the second
conditional update is refused and its operation waits; without it both deploys reach MAAS.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import pytest_asyncio
from pydantic import SecretStr

from gpuaas_common.bus import HandlerContext, deliver
from gpuaas_common.contract import Envelope, spec_for
from gpuaas_common.db import create_pool
from gpuaas_common.migrations import apply_migrations
from gpuaas_common.unit_of_work import UnitOfWork
from gpuaas_dev.maas_sim import SimConfig, start, state_of, system_id_for
from gpuaas_maas_gateway.adapters.repository import PostgresGateway, gateway_repositories
from gpuaas_maas_gateway.entrypoints.main import build_clients
from gpuaas_maas_gateway.service_layer.commands import OperationHandlers
from gpuaas_maas_gateway.service_layer.worker import OperationWorker
from gpuaas_maas_gateway.settings import GatewaySettings, SiteProfile

KEY = "Gw7sQ2mZp9LxVb3Nq4:Gt8wR1nYc6HjDf2Gs5:Gs3vB9mQ7pL2kJ8hG4fD1sA6zX0cV5bN"


@pytest_asyncio.fixture
async def pool(fresh_db: str) -> AsyncIterator[asyncpg.Pool]:
    conn = await asyncpg.connect(fresh_db)
    await apply_migrations(conn, "maas_gateway", "gpuaas_maas_gateway.migrations")
    await conn.close()
    p = await create_pool(fresh_db, "maas_gateway", min_size=2, max_size=10)
    yield p
    await p.close()


class MeetingCredentials:
    """Host credentials whose issue() (called between the busy check and the state change of a deploy)
    returns only once both workers are there."""

    def __init__(self, barrier: asyncio.Barrier) -> None:
        self.barrier = barrier

    async def issue(self, allocation_id: str, node_id: str, *, command_seq: int, slice_host: bool = False) -> str:
        # Bounded, so a worker that never arrives fails the test instead of hanging it.
        await asyncio.wait_for(self.barrier.wait(), timeout=10)
        return "-----BEGIN NATS USER JWT-----\nx\n------END NATS USER JWT------\n"

    async def end_slice_identity(self, node_id: str, keep_allocation: str | None = None) -> int:
        return 0

    async def revoke_allocation(self, allocation_id: str) -> int:
        return 0


async def record_deploy(pool: asyncpg.Pool, settings: GatewaySettings, op_id: str, system_id: str) -> None:
    type_ = "maas.deploy_requested"
    model = spec_for(type_).model(
        operation_id=op_id,
        allocation_id=uuid.uuid4(),
        site="default",
        system_id=system_id,
        node_id="bm-01",
        profile="h200-baremetal",
    )
    env = Envelope.wrap(type_, model.model_dump(mode="json"), producer="test", correlation_id=op_id)
    # A stream position as the bus gives it: the deploy's mint names its command by it.
    ctx = HandlerContext(env, model, spec_for(type_).address, "maas-gateway-commands", 1, stream_seq=1)
    assert await deliver(
        OperationHandlers(settings).on_command,
        ctx,
        UnitOfWork(pool, "maas_gateway", "maas-gateway", gateway_repositories),
    )


async def test_two_workers_never_both_submit_to_one_machine(pool: asyncpg.Pool) -> None:
    config = SimConfig(machines=1, api_key=KEY, seed=7)
    config.timers = config.timers.updated(deploying=30.0)
    runner, port = await start(config, "127.0.0.1", 0)
    sim = state_of(runner)
    sid = system_id_for("bm-01")
    settings = GatewaySettings(
        maas_url=f"http://127.0.0.1:{port}/MAAS/",
        maas_api_key=SecretStr(KEY),
        maas_timeout_s=2.0,
        maas_poll_interval_s=0.05,
        maas_grace_s=5.0,
        maas_deadline_s=60.0,
        site_profiles={"h200-baremetal": SiteProfile(distro_series="noble")},
    )
    barrier = asyncio.Barrier(2)
    workers = [
        OperationWorker(
            settings, PostgresGateway(pool), build_clients(settings), host_credentials=MeetingCredentials(barrier)
        )
        for _ in range(2)
    ]
    try:
        await record_deploy(pool, settings, "deploy-a", sid)
        await record_deploy(pool, settings, "deploy-b", sid)
        await asyncio.gather(workers[0].step("deploy-a"), workers[1].step("deploy-b"))
        rows: dict[str, Any] = {
            r["operation_id"]: dict(r)
            for r in await pool.fetch("SELECT operation_id, state, maas_calls FROM maas_operations")
        }
    finally:
        for worker in workers:
            for client in worker.sites.values():
                await client.client.close()
        await runner.cleanup()

    assert sim.call_count("deploy", sid) == 1
    states = sorted((r["state"], r["maas_calls"]) for r in rows.values())
    # One was sent and taken; the other was held back before any call and waits its turn.
    assert states == [("accepted", 1), ("pending", 0)], rows
