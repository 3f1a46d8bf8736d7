"""The stack on a 3-node NATS cluster with two replicas of every service: allocations flow while a replica of
each service is killed -9 and the leader of the allocations stream dies, and nothing is lost or held twice."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import AsyncIterator, Iterator

import nats
import nats.errors
import nats.js.errors
import pytest

from gpuaas_common.jetstream import CONSUMERS
from gpuaas_dev.stack import Stack
from gpuaas_dev.testing.bus_spy import BusSpy
from gpuaas_dev.testing.invariants import database_violations, wait_consumers_drained, wait_outboxes_empty
from gpuaas_dev.testing.waiting import eventually

from .conftest import Portal

pytestmark = pytest.mark.e2e

REPLICATED = ("allocator", "scheduler", "image-pipeline", "maas-gateway")


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    # Postgres without fsync: this test is about NATS servers and replicas dying, not the database.
    s = Stack(
        tmp_path_factory.mktemp("cluster"),
        slice_hosts=2,
        slots_per_host=8,
        baremetal_hosts=1,
        nats_cluster=3,
        replicas=2,
        unsafe_no_fsync=True,
    )
    s.start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
async def portal(stack: Stack) -> AsyncIterator[Portal]:
    spy = await BusSpy(stack.nats_url, connect=stack.nats_options("admin")).start()
    nc = await nats.connect(**stack.nats_options("admin"), max_reconnect_attempts=-1, reconnect_time_wait=0.2)
    yield Portal(stack, spy, nc)
    await nc.drain()
    await spy.stop()
    assert spy.violations == [], f"messages broke the contract: {spy.violations[:5]}"


async def test_the_stack_runs_replicated_on_a_cluster(stack: Stack, portal: Portal) -> None:
    assert len(stack.nats_servers) == 3 and len(stack.nats_url.split(",")) == 3
    for service in REPLICATED:
        assert stack.replica_names(service) == [service, f"{service}-2"]
        assert all(stack.is_running(name) for name in stack.replica_names(service))
    info = await portal.js.stream_info("ALLOCATIONS")
    assert info.config.num_replicas == 3


async def test_allocations_survive_a_killed_replica_of_each_service_and_a_dead_nats_leader(
    stack: Stack, portal: Portal
) -> None:
    allocs = [await portal.request("gpu_slice", gpus=1) for _ in range(6)]
    # Faults while the first ones are in flight: one replica of every service, then the stream leader.
    for service in REPLICATED:
        stack.kill(f"{service}-2", signal.SIGKILL)
    leader = (await portal.js.stream_info("ALLOCATIONS")).cluster.leader
    victim = next(s for s in stack.nats_servers if s.server_name == leader)
    victim.kill()

    async def new_leader() -> bool:
        try:
            info = await portal.js.stream_info("ALLOCATIONS")
        except (nats.errors.TimeoutError, nats.js.errors.APIError):
            return False  # no leader while the election runs
        return bool(info.cluster.leader) and info.cluster.leader != leader

    await eventually(new_leader, timeout=60, what="a new ALLOCATIONS leader")
    allocs += [await portal.request("gpu_slice", gpus=1) for _ in range(6)]

    await asyncio.gather(*(portal.wait_state(a, "active", timeout=180) for a in allocs))
    victim.start()
    for service in REPLICATED:
        stack.restart(f"{service}-2")
    for a in allocs:
        await portal.release(a)
    await asyncio.gather(*(portal.wait_state(a, "released", timeout=180) for a in allocs))

    for a in allocs:
        assert len(portal.spy.of_type("allocation.active", allocation_id=a)) >= 1
        # The spy is a core-NATS subscriber: while the server it is connected to is dead it misses messages, so
        # the node is read from every event naming it (a run saw no copy of one `placement.placed` at all).
        nodes = {
            e["payload"]["node_id"]
            for t in ("placement.placed", "allocation.placed", "allocation.active")
            for e in portal.spy.of_type(t, allocation_id=a)
        }
        assert len(nodes) == 1, f"{a} placed on {nodes}"
    # `released` is on the bus; the scheduler frees the claims when it has handled it: wait for every durable
    # and every outbox to drain before reading the databases.
    durables = [(c.stream, c.durable) for c in CONSUMERS]
    assert not {d: f for d, f in (await wait_consumers_drained(portal.js, durables, 120)).items() if any(f.values())}
    conn = await stack.open_databases()
    try:
        assert await wait_outboxes_empty(conn, timeout_s=60)
        assert await database_violations(conn) == []
        states = await conn.fetch(
            "SELECT state, count(*) AS n FROM allocator.allocations WHERE allocation_id = ANY($1::uuid[]) GROUP BY 1",
            allocs,
        )
    finally:
        await conn.close()
    assert {r["state"]: r["n"] for r in states} == {"released": len(allocs)}
    assert stack.crashed() == []
