"""An operator's parity ask end to end over real nats-server and Postgres: the admin API records the ask and queues
`slice.parity_check`; the host's agent (on a generated XE9680L host) runs its checks and publishes
`node.parity_reported` with the ask's task id (every message checked against the contract by the spy); the
scheduler's own parity durable takes it and closes the ask with what the checks found, on the node's history."""

from __future__ import annotations

import uuid
from pathlib import Path

import nats
import pytest

from gpuaas_common.bus import Bus
from gpuaas_common.bus_dispatch import HandlerContext
from gpuaas_common.bus_parsing import parse_message
from gpuaas_common.jetstream import CONSUMER_BY_NAME, ensure_consumer
from gpuaas_dev.sim.fixture_host import build_host_root, xe9680l
from gpuaas_dev.testing.waiting import eventually
from gpuaas_node_agent.adapters.libvirt_host import LibvirtHost
from gpuaas_node_agent.adapters.state_store import StateStore
from gpuaas_node_agent.service_layer.host_paths import HostPaths
from gpuaas_node_agent.service_layer.tasks import SliceHostAgent
from gpuaas_scheduler.adapters import synthetic
from gpuaas_scheduler.service_layer.handlers import Scheduler, evidence_handlers

from .scheduler_db import ADMIN_AUTH, admin_client, scheduler_pool
from .test_node_agent_tasks import publish, spy  # noqa: F401  (fixtures)

MIB = 1 << 20


@pytest.fixture
async def scheduler_side(fresh_db, nats_server, publish):  # noqa: F811  (publish provisions the streams)
    async with scheduler_pool(fresh_db) as pool:
        async with pool.acquire() as conn:
            await synthetic.build(conn, slice_hosts=1, prefix=f"p{uuid.uuid4().hex[:4]}")
            node_id = await conn.fetchval("SELECT node_id FROM nodes")
        bus_nc = await nats.connect(nats_server.url)
        nc = await nats.connect(nats_server.url)
        spec = CONSUMER_BY_NAME["scheduler-node-parity"]
        await ensure_consumer(nc.jetstream(), spec)
        bus = Bus(bus_nc, nc.jetstream(), service="scheduler", schema="scheduler", pool=pool, retry_delays_s=(0.05,))
        bus.subscribe(spec, evidence_handlers(Scheduler())["scheduler-node-parity"])
        await bus.start()
        try:
            async with admin_client(pool) as api:
                yield node_id, pool, api
        finally:
            await bus.stop()
            await bus_nc.close()
            await nc.drain()


async def test_an_operators_parity_ask_is_answered_by_the_hosts_agent_and_closed_by_its_report(
    tmp_path: Path,
    scheduler_side,
    publish,  # noqa: F811
    spy,  # noqa: F811
) -> None:
    node_id, pool, api = scheduler_side
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
        resp = await api.post(
            f"/v1/nodes/{node_id}/parity",
            json={"actor": "ops", "reason": "after a firmware update"},
            headers={**ADMIN_AUTH, "Idempotency-Key": uuid.uuid4().hex},
        )
        assert resp.status == 200, await resp.json()
        task_id = (await resp.json())["action"]["action_id"]
        # The task as the outbox relay would publish it, taken by the agent's task handler.
        row = await pool.fetchrow(
            "SELECT subject, body FROM outbox WHERE subject = $1", f"gpuaas.node.{node_id}.tasks.slice.parity_check"
        )
        envelope, payload = parse_message(row["subject"], bytes(row["body"]))
        assert envelope.type == "slice.parity_check"
        await agent.on_parity_check(HandlerContext(envelope, payload, row["subject"], f"node-{node_id}", 1))

        reported = await spy.wait_type("node.parity_reported", task_id=task_id)
        # Parity alone: the host's candidates stay as ops are approving them.
        assert spy.of_type("node.topology_reported", task_id=task_id) == []
        failed = sorted(c["check"] for c in reported["payload"]["checks"] if c["status"] == "FAIL")

        async def closed():
            doc = await (await api.get(f"/v1/nodes/{node_id}", headers=ADMIN_AUTH)).json()
            ask = doc["actions"][0]
            return ask if ask["status"] != "requested" else None

        ask = await eventually(closed, what="the parity ask closed by the agent's report")
        assert ask["action_id"] == task_id
        assert ask["status"] == ("failed" if failed else "succeeded")
        assert ask["result"]["parity"]["failed_checks"] == [
            c["check"] for c in reported["payload"]["checks"] if c["status"] == "FAIL"
        ]
        assert await pool.fetchval("SELECT parity_detail->>'task_id' FROM nodes WHERE node_id = $1", node_id) == task_id
    finally:
        await libvirt.close()
        store.close()
