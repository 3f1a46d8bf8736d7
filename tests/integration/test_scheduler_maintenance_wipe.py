"""A host back from maintenance owes its wipe proof for every slot disk (issue 38, point 1): a technician may have
swapped or touched them. Over real Postgres, real nats-server, the scheduler's admin HTTP API, its outbox relay
and its own durable for the hosts' wipe reports:

(a) drain with maintenance, then undrain: the free slots are `awaiting_wipe` (a disabled one is asked where it
    is, one in use is left to its release's cleanup), placed nowhere; the `slice.slot_wipe` task is on the bus;
    the host's passing report on its own subject frees them;
(b) a drain that was no maintenance, undrained, changes no slot and asks no wipe.
The bus spy validates every message on the bus against the contract."""

# ruff: noqa: F811 - the node-agent tests' fixtures, imported by name, are parameters here
from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import asyncpg
import nats
import pytest
from aiohttp.test_utils import TestClient

from gpuaas_common.bus import Bus
from gpuaas_common.contract import messages as m
from gpuaas_common.jetstream import CONSUMER_BY_NAME, ensure_consumer
from gpuaas_common.outbox import OutboxRelay
from gpuaas_dev.cli.inventory import _node_detail_text
from gpuaas_dev.testing.bus_spy import BusSpy
from gpuaas_dev.testing.waiting import eventually
from gpuaas_scheduler.adapters import synthetic
from gpuaas_scheduler.service_layer.handlers import Scheduler, evidence_handlers

from .scheduler_db import accepted, admin_client, place_and_activate, post, run_place, scheduler_pool
from .test_node_agent_tasks import publish, spy  # noqa: F401 - fixtures (publish provisions the streams)


@dataclass
class Side:
    pool: asyncpg.Pool
    api: TestClient
    node: str
    slots: list[str]


@pytest.fixture
async def side(fresh_db, nats_server, publish) -> AsyncIterator[Side]:
    async with scheduler_pool(fresh_db) as pool:
        async with pool.acquire() as conn:
            [node] = await synthetic.build(conn, slice_hosts=1, prefix=f"mw{uuid.uuid4().hex[:4]}")
            slots = [r["slot_id"] for r in await conn.fetch("SELECT slot_id FROM node_resource_slots ORDER BY 1")]
        bus_nc = await nats.connect(nats_server.url)
        nc = await nats.connect(nats_server.url)
        spec = CONSUMER_BY_NAME["scheduler-node-slot-wipes"]
        await ensure_consumer(nc.jetstream(), spec)
        bus = Bus(bus_nc, nc.jetstream(), service="scheduler", schema="scheduler", pool=pool, retry_delays_s=(0.05,))
        bus.subscribe(spec, evidence_handlers(Scheduler())["scheduler-node-slot-wipes"])
        await bus.start()
        relay = OutboxRelay(fresh_db, "scheduler", nc.jetstream(), poll_interval_s=0.1)
        relay_task = asyncio.create_task(relay.run())
        try:
            async with admin_client(pool) as api:
                yield Side(pool, api, node, slots)
        finally:
            relay.stop()
            relay_task.cancel()
            await asyncio.gather(relay_task, return_exceptions=True)
            await bus.stop()
            await bus_nc.close()
            await nc.drain()


async def statuses(pool: asyncpg.Pool) -> dict[str, str]:
    async with pool.acquire() as conn:
        return {r["slot_id"]: r["status"] for r in await conn.fetch("SELECT slot_id, status FROM node_resource_slots")}


async def wipe_asks(pool: asyncpg.Pool) -> list[dict[str, Any]]:
    async with pool.acquire() as conn:
        rows = await conn.fetch("SELECT task_id, slot_id, cause, outcome FROM slot_wipes ORDER BY slot_id")
    return [dict(r) for r in rows]


def passing_report(task: dict[str, Any]) -> m.NodeSlotWipeReported:
    return m.NodeSlotWipeReported(
        task_id=task["task_id"],
        node_id=task["node_id"],
        outcomes=[
            m.SlotWipeOutcome(
                slot_id=s["slot_id"],
                device=s["nvme_by_id"],
                proof=m.WipeProof(
                    device=s["nvme_by_id"],
                    method="blkdiscard",
                    verified=True,
                    signatures=[],
                    verification="wipefs and blkid find nothing; 64 sampled blocks read back as zeros",
                ),
            )
            for s in task["slots"]
        ],
    )


async def test_a_host_back_from_maintenance_serves_slices_again_only_on_its_wipe_proof(
    side: Side,
    publish,
    spy: BusSpy,
) -> None:
    pool, api, node = side.pool, side.api, side.node
    # Before the maintenance: two slots under a claim (releasing), one disabled by ops, the rest free.
    placed = await place_and_activate(pool)
    in_use = sorted(s.slot_id for s in placed.slots)
    disabled = next(s for s in side.slots if s not in in_use)
    status, body = await post(api, f"/v1/slots/{disabled}/disable", {"actor": "ops", "reason": "flaky fan"})
    assert status == 200, body
    free = sorted(set(side.slots) - set(in_use) - {disabled})

    status, body = await post(
        api, f"/v1/nodes/{node}/drain", {"actor": "ops", "reason": "swap NVMe bay 3", "maintenance": True}
    )
    assert status == 200 and body["node"]["maintenance"], body
    status, body = await post(api, f"/v1/nodes/{node}/undrain", {"actor": "ops", "reason": "bay 3 swapped"})

    assert status == 200, body
    assert not body["node"]["draining"] and not body["node"]["maintenance"]
    task_id = body["wipe_task"]
    assert task_id and body["awaiting_wipe"] == free and body["wipe_asked"] == sorted([*free, disabled])
    now = await statuses(pool)
    assert {now[s] for s in free} == {"awaiting_wipe"}
    assert now[disabled] == "disabled" and {now[s] for s in in_use} == {"releasing"}
    assert body["node"]["free_slots"] == 0
    # `gpuaas nodes undrain` says so.
    text = _node_detail_text(body, "table", False)
    assert f"wipe asked of the host: task {task_id}" in text and f"awaiting_wipe: {', '.join(free)}" in text
    u = (await run_place(pool, accepted(1))).unschedulable
    assert u is not None and u.free_gpus == 0, u
    # Recorded: each move in the slot's history with its task, the asks, the undrain's audit row.
    async with pool.acquire() as conn:
        moves = await conn.fetch(
            "SELECT slot_id, from_status, to_status, actor, reason, detail->>'wipe_task' AS task "
            "FROM slot_transitions WHERE to_status = 'awaiting_wipe' ORDER BY slot_id"
        )
        audit = await conn.fetchrow("SELECT reason, detail FROM admin_audit WHERE action = 'node.undrain'")
    assert [(r["slot_id"], r["from_status"], r["actor"], r["task"]) for r in moves] == [
        (s, "available", "ops", task_id) for s in free
    ]
    assert all("back from maintenance" in r["reason"] for r in moves)
    assert audit["reason"] == "bay 3 swapped" and json.loads(audit["detail"])["wipe_task"] == task_id
    asks = await wipe_asks(pool)
    assert [(a["slot_id"], a["task_id"], a["cause"], a["outcome"]) for a in asks] == [
        (s, task_id, "maintenance", None) for s in sorted([*free, disabled])
    ]
    # The task reached the host's task subject (the spy checked it against the contract), with the site's policy.
    [sent] = await eventually(lambda: spy.of_type("slice.slot_wipe", task_id=task_id), what="the wipe task on the bus")
    task = sent["payload"]
    assert task["node_id"] == node and sorted(s["slot_id"] for s in task["slots"]) == sorted([*free, disabled])
    assert {s["wipe_policy"] for s in task["slots"]} == {"blkdiscard"}
    announced = await eventually(
        lambda: spy.of_type("scheduler.slots_changed", node_id=node, cause="maintenance"), what="the announcement"
    )
    assert {s["status"] for s in announced[-1]["payload"]["slots"] if s["slot_id"] in free} == {"awaiting_wipe"}
    # Repairing the disabled slot waits for the host's proof of its disk.
    status, refused = await post(api, f"/v1/slots/{disabled}/repair", {"actor": "ops", "reason": "fan fixed"})
    assert status == 409 and refused["error"]["code"] == "awaiting_wipe_proof", refused

    # The host's passing proofs, published on its own report subject and taken by the scheduler's durable.
    report = passing_report(task)
    await publish("node.slot_wipe_reported", report, correlation_id=task_id, node_id=node)

    async def freed() -> bool:
        return {(await statuses(pool))[s] for s in free} == {"available"}

    await eventually(freed, what="the free slots back in service")
    now = await statuses(pool)
    assert now[disabled] == "disabled" and {now[s] for s in in_use} == {"releasing"}
    assert {a["outcome"] for a in await wipe_asks(pool)} == {"passed"}
    placed_again = (await run_place(pool, accepted(4))).placed
    assert placed_again is not None and placed_again.node_id == node
    # The disabled slot's disk is proven now: its repair goes through.
    status, repaired = await post(api, f"/v1/slots/{disabled}/repair", {"actor": "ops", "reason": "fan fixed"})
    assert status == 200 and repaired["slot"]["status"] == "available", repaired


async def test_a_plain_drain_and_undrain_change_no_slot_and_ask_no_wipe(side: Side, spy: BusSpy) -> None:
    pool, api, node = side.pool, side.api, side.node
    before = await statuses(pool)
    status, body = await post(api, f"/v1/nodes/{node}/drain", {"actor": "ops", "reason": "noisy neighbour"})
    assert status == 200 and body["node"]["draining"] and not body["node"]["maintenance"], body
    status, body = await post(api, f"/v1/nodes/{node}/undrain", {"actor": "ops", "reason": "quiet again"})

    assert status == 200, body
    assert "wipe_task" not in body and "awaiting_wipe" not in body
    assert await statuses(pool) == before == dict.fromkeys(side.slots, "available")
    assert await wipe_asks(pool) == []
    async with pool.acquire() as conn:
        assert await conn.fetchval("SELECT count(*) FROM slot_transitions WHERE to_status = 'awaiting_wipe'") == 0
    placed = (await run_place(pool, accepted(4))).placed
    assert placed is not None and placed.node_id == node
    assert spy.of_type("slice.slot_wipe", node_id=node) == []
