"""Drift end to end over real nats-server and Postgres: the agent's reconciler on a generated XE9680L host
publishes `node.drift_reported` (checked against the contract by the spy), the scheduler's own durable and
handler take it, and the slot whose GPU lost its vfio-pci binding leaves placement until the agent reports it
clean again."""

from __future__ import annotations

import uuid
from pathlib import Path

import nats
import pytest

from gpuaas_common.bus import Bus
from gpuaas_common.jetstream import CONSUMER_BY_NAME, ensure_consumer
from gpuaas_dev.sim.fixture_host import build_host_root, xe9680l
from gpuaas_dev.testing.waiting import eventually
from gpuaas_node_agent.adapters.host import Host
from gpuaas_node_agent.adapters.libvirt_host import LibvirtHost
from gpuaas_node_agent.adapters.state_store import StateStore
from gpuaas_node_agent.service_layer.host_paths import HostPaths
from gpuaas_node_agent.service_layer.tasks import SliceHostAgent
from gpuaas_scheduler.adapters import synthetic
from gpuaas_scheduler.service_layer.handlers import Scheduler, evidence_handlers

from .scheduler_db import scheduler_pool
from .test_node_agent_reconciler import _bind
from .test_node_agent_tasks import publish, spy  # noqa: F401  (fixtures)

MIB = 1 << 20


@pytest.fixture
async def scheduler_side(fresh_db, nats_server, publish):  # noqa: F811  (publish provisions the streams)
    async with scheduler_pool(fresh_db) as pool:
        async with pool.acquire() as conn:
            await synthetic.build(conn, slice_hosts=1, prefix=f"d{uuid.uuid4().hex[:4]}")
            node_id = await conn.fetchval("SELECT node_id FROM nodes")
        bus_nc = await nats.connect(nats_server.url)
        nc = await nats.connect(nats_server.url)
        spec = CONSUMER_BY_NAME["scheduler-node-drift"]
        await ensure_consumer(nc.jetstream(), spec)
        bus = Bus(bus_nc, nc.jetstream(), service="scheduler", schema="scheduler", pool=pool, retry_delays_s=(0.05,))
        bus.subscribe(spec, evidence_handlers(Scheduler())["scheduler-node-drift"])
        await bus.start()
        try:
            yield node_id, pool
        finally:
            await bus.stop()
            await bus_nc.close()
            await nc.drain()


async def test_the_agent_reports_binding_drift_and_the_scheduler_stops_placing_on_that_slot(
    tmp_path: Path,
    scheduler_side,
    publish,  # noqa: F811
    spy,  # noqa: F811
) -> None:
    node_id, pool = scheduler_side
    root = build_host_root(tmp_path / "host", xe9680l(node_id, disk_file_bytes=MIB))
    node_xml = tmp_path / "hypervisor.xml"
    node_xml.write_text("<node>\n</node>\n")
    libvirt = LibvirtHost(f"test://{node_xml}", poll_interval_s=0.02)
    store = StateStore(root / "var/lib/gpuaas/agent/agent.sqlite")
    agent = SliceHostAgent(
        node_id,
        HostPaths(root),
        store,
        libvirt,
        publish,
        hostsdir="/etc/gpuaas/dnsmasq-hosts",
        lease_file="/var/lib/misc/dnsmasq.leases",
        seed_dir="/var/lib/gpuaas/seeds",
        ssh_port=22,
        readiness_timeout_s=5,
        shutdown_timeout_s=1,
    )
    try:

        async def slot_drift() -> list[tuple]:
            async with pool.acquire() as conn:
                rows = await conn.fetch("SELECT slot_id, kind, status FROM node_drift ORDER BY drift_id")
            return [tuple(r) for r in rows]

        async def free_slots() -> int:
            async with pool.acquire() as conn:
                return await conn.fetchval("SELECT free_slots FROM nodes WHERE node_id = $1", node_id)

        assert await free_slots() == 8
        # Someone binds the first GPU to its host driver by hand; its persistent override is still there.
        gpu = "0000:18:00.0"
        _bind(root, gpu, "nvidia")
        drift = await agent.report_drift()
        assert [(d.kind, d.subject, d.slot_ids) for d in drift] == [("device_binding", gpu, ())]
        await eventually(
            lambda: _equals(slot_drift(), [(f"{node_id}-s0", "device_binding", "open")]), what="drift recorded"
        )
        assert await free_slots() == 7
        sent = spy.of_type("node.drift_reported", node_id=node_id)
        assert [d["subject"] for d in sent[-1]["payload"]["drift"]] == [gpu]

        # Put right on the host (driverctl rebinds to the override): the next pass reports the host clean and
        # the slot is placeable again.
        assert (await Host.at(root).run.run("driverctl", "set-override", gpu, "vfio-pci")).ok
        assert await agent.report_drift() == []
        await eventually(
            lambda: _equals(slot_drift(), [(f"{node_id}-s0", "device_binding", "resolved")]), what="drift resolved"
        )
        assert await free_slots() == 8
    finally:
        await libvirt.close()
        store.close()


async def _equals(awaitable, expected) -> bool:
    return await awaitable == expected
