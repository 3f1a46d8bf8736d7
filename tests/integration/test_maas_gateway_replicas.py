"""Gateway replicas: several OperationWorkers on one database, against the MAAS simulator.

Each operation is stepped by one worker at a time, the one holding its lease; a worker that is killed
mid-call leaves its lease to expire, and only then does another take the operation over, as an unknown
outcome resolved by reading the machine; a (re)starting worker leaves a live worker's call alone.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import random
import signal
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import asyncpg

from gpuaas_dev.maas_sim import Fault, state_of, system_id_for
from gpuaas_dev.maas_sim.handlers.routes import ROUTES
from gpuaas_dev.testing.waiting import eventually
from gpuaas_maas_gateway.adapters.maas_client import MaasClient
from gpuaas_maas_gateway.adapters.repository import PostgresGateway
from gpuaas_maas_gateway.service_layer.worker import OperationWorker

from .test_maas_gateway_worker import KEY, Gateway, pool, settings_for, start_sim, url  # noqa: F401 (fixture)

MUTATIONS = {op.name for route in ROUTES for op in route.operations if op.mutation}


def mutations(sim: Any) -> dict[str, dict[str, int]]:
    return {op: calls for op, calls in sim.calls_snapshot().items() if op in MUTATIONS}


async def test_two_workers_make_each_maas_call_once(pool: asyncpg.Pool, tmp_path: Path) -> None:  # noqa: F811
    machines = 8
    runner, port = await start_sim(machines + 1)
    sim = state_of(runner)
    sids = [system_id_for(f"bm-{i:02d}") for i in range(1, machines + 1)]
    commissioned = [system_id_for(f"bm-{machines + 1:02d}")]
    image = tmp_path / "host.tar.gz"
    content = random.Random(5).randbytes(200_000)  # 4 chunks of 64 KiB
    image.write_bytes(content)
    settings = settings_for(url(port), maas_uploaded_images=())
    try:
        async with Gateway(pool, settings) as one, Gateway(pool, settings) as two:
            ops = [await one.deploy(sid, f"d-{sid}") for sid in sids]
            for sid in commissioned:
                ops.append(
                    await two.command(
                        "maas.commission_requested",
                        operation_id=f"c-{sid}",
                        site="default",
                        system_id=sid,
                        commissioning_scripts=["gpuaas-fw"],
                        scripts=[{"name": "gpuaas-fw", "script": "#!/bin/sh\necho fw\n"}],
                    )
                )
            ops.append(
                await one.command(
                    "maas.tags_sync_requested",
                    operation_id="tags-1",
                    site="default",
                    profile="h200-baremetal",
                    add_system_ids=sids[:3],
                    remove_system_ids=[],
                )
            )
            ops.append(
                await two.command(
                    "maas.image_upload_requested",
                    operation_id="up-1",
                    site="default",
                    name="custom/gpuaas-host",
                    title="host",
                    source_path=str(image),
                    sha256=hashlib.sha256(content).hexdigest(),
                    size=len(content),
                )
            )
            rows = [await one.finished(op) for op in ops]
            events = await one.events()
    finally:
        await runner.cleanup()

    assert {r["state"] for r in rows} == {"succeeded"}, [(r["operation_id"], r["state"], r["last_error"]) for r in rows]
    assert mutations(sim) == {
        "deploy": {sid: 1 for sid in sids},
        # The site profile's storage layout (flat) is set before each deploy, once too.
        "set_storage_layout": {sid: 1 for sid in sids},
        "commission": {sid: 1 for sid in commissioned},
        "scripts.create": {"": 1},
        "tags.create": {"": 2},
        "tag.update_nodes": {"": 2},
        "boot_resources.create": {"": 1},
        "boot_resource.upload": {"": 4},
    }
    assert all(r["maas_calls"] == 1 and r["resolution"] == "direct" for r in rows if r["kind"] == "deploy")
    results = [e["payload"]["operation_id"] for e in events if e["subject"].startswith("gpuaas.maas.result.")]
    assert sorted(results) == sorted(ops)


WORKER = """
import asyncio, json, os, sys
from gpuaas_common.db import create_pool
from gpuaas_maas_gateway.adapters.repository import PostgresGateway
from gpuaas_maas_gateway.entrypoints.main import build_clients
from gpuaas_maas_gateway.service_layer.worker import OperationWorker
from gpuaas_maas_gateway.settings import GatewaySettings

async def main():
    settings = GatewaySettings(**json.loads(os.environ["TEST_GATEWAY_SETTINGS"]))
    pool = await create_pool(os.environ["TEST_GATEWAY_DSN"], "maas_gateway", min_size=1, max_size=4)
    await OperationWorker(settings, PostgresGateway(pool), build_clients(settings)).run()

asyncio.run(main())
"""


async def test_a_killed_workers_call_is_taken_over_after_its_lease_and_resolved_by_reading(
    pool: asyncpg.Pool,  # noqa: F811
    fresh_db: str,
) -> None:
    runner, port = await start_sim(1)
    sim = state_of(runner)
    sid = system_id_for("bm-01")
    # MAAS takes the deploy and never answers: the worker is inside the call when it is killed.
    sim.faults.add(Fault("lost_after_commit", op="deploy", count=1, mode="hold"))
    settings = settings_for(url(port), maas_timeout_s=1.5)
    overrides = {
        k: v
        for k, v in settings.model_dump(mode="json").items()
        if (k.startswith("maas_") or k == "site_profiles") and k != "maas_api_key"
    }
    env = {
        **os.environ,
        "TEST_GATEWAY_DSN": fresh_db,
        "TEST_GATEWAY_SETTINGS": json.dumps({**overrides, "maas_api_key": KEY}),
    }
    victim = await asyncio.create_subprocess_exec(sys.executable, "-c", WORKER, env=env)
    gw = Gateway(pool, settings)  # records commands and reads rows; its own worker is never started
    try:
        op = await gw.deploy(sid, "d-killed")

        async def in_the_call() -> dict[str, Any] | None:
            row = await gw.op(op)
            return row if row["state"] == "submitting" and sim.call_count("deploy", sid) == 1 else None

        held = await eventually(in_the_call, timeout=30, interval=0.01, what="the victim inside its deploy call")
        os.kill(victim.pid, signal.SIGKILL)
        await victim.wait()
        row = await gw.op(op)
        assert row["lease_owner"] == held["lease_owner"] and row["lease_owner"] is not None
        lease_until = row["lease_until"]

        # Another worker starts; the call stays the dead worker's until its lease runs out.
        survivor = OperationWorker(settings, PostgresGateway(pool), gw.clients)
        task = asyncio.ensure_future(survivor.run())
        try:
            row = await gw.finished(op, timeout=30)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await survivor.aclose()
        result = await gw.result_of(op)
    finally:
        if victim.returncode is None:
            victim.kill()
            await victim.wait()
        for client in gw.clients.values():
            await client.close()
        await runner.cleanup()

    assert row["state"] == "succeeded" and row["resolution"] == "polled", row
    # Taken over only once the lease had expired, and then watched, not sent again.
    assert row["unknown_since"] >= lease_until
    assert (row["maas_calls"], row["resubmits"]) == (1, 0)
    assert sim.call_count("deploy", sid) == 1
    assert result["payload"]["status"] == "deployed" and result["payload"]["resolution"] == "polled"
    assert row["lease_owner"] is None and row["lease_until"] is None


class HeldDeploys(MaasClient):
    """A client whose deploy waits at the door until the test opens it (the row is `submitting` by then)."""

    def __init__(self, *args: Any, door: asyncio.Event, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.door = door
        self.waiting = 0

    async def deploy(self, *args: Any, **kwargs: Any) -> Any:
        self.waiting += 1
        await self.door.wait()
        return await super().deploy(*args, **kwargs)


class CountingWorker(OperationWorker):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.ticks = 0

    async def tick(self) -> None:
        await super().tick()
        self.ticks += 1


async def test_a_starting_worker_leaves_a_live_workers_call_alone(pool: asyncpg.Pool) -> None:  # noqa: F811
    runner, port = await start_sim(1)
    sim = state_of(runner)
    sid = system_id_for("bm-01")
    # A tiny grace: a worker that took the call for interrupted would soon see the machine untouched
    # and deploy it again.
    settings = settings_for(url(port), maas_grace_s=0.05)
    door = asyncio.Event()
    held = HeldDeploys(url(port), KEY, timeout=settings.maas_timeout_s, door=door)
    live = OperationWorker(settings, PostgresGateway(pool), {"default": held})
    tasks: list[asyncio.Task[None]] = []
    starting: CountingWorker | None = None

    async def spawn(run: Callable[[], Awaitable[None]]) -> None:
        tasks.append(asyncio.ensure_future(run()))

    gw = Gateway(pool, settings)  # records commands and reads rows; its own worker is never started
    try:
        op = await gw.deploy(sid, "d-live")
        await spawn(live.run)
        await eventually(lambda: held.waiting == 1, timeout=10, interval=0.01, what="the live worker's call")
        assert (await gw.op(op))["state"] == "submitting"

        starting = CountingWorker(settings, PostgresGateway(pool), gw.clients)
        await spawn(starting.run)
        await eventually(lambda: starting.ticks >= 5, timeout=10, interval=0.01, what="five ticks of a new worker")
        row = await gw.op(op)
        assert row["state"] == "submitting" and row["unknown_since"] is None, row

        door.set()
        row = await gw.finished(op)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await live.aclose()
        if starting is not None:
            await starting.aclose()
        await held.close()
        for client in gw.clients.values():
            await client.close()
        await runner.cleanup()

    assert row["state"] == "succeeded" and row["resolution"] == "direct", row
    assert (row["maas_calls"], row["resubmits"], row["unknown_since"]) == (1, 0, None)
    assert sim.call_count("deploy", sid) == 1
