"""Recovery time on a real nats-server: the ack wait is short, a slow handler keeps its message with progress
acks, and a message whose consumer process was killed goes to another consumer once the ack wait has passed.
How quickly that happens is measured in bench/, not asserted here."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import uuid
from typing import Any

import nats

from gpuaas_common.bus import Bus, HandlerContext
from gpuaas_common.contract import Envelope
from gpuaas_common.contract import messages as m
from gpuaas_common.jetstream import CONSUMERS, ConsumerSpec, node_agent_consumer
from gpuaas_common.settings import ServiceSettings
from gpuaas_dev.testing.durables import durable_at_end
from gpuaas_dev.testing.waiting import eventually

SUBJECT = "gpuaas.allocation.release_requested"
ACK_WAIT_S = 1.0


async def _durable_at_end(js: Any) -> ConsumerSpec:
    """A durable with a 1 s ack wait that starts after every message already in the stream."""
    return await durable_at_end(js, "recovery", SUBJECT, ack_wait_s=ACK_WAIT_S, max_deliver=5)


async def _publish_release(js: Any) -> tuple[uuid.UUID, str]:
    alloc = uuid.uuid4()
    env = Envelope.wrap(
        "allocation.release_requested",
        m.AllocationReleaseRequested(allocation_id=alloc, reason="recovery test").model_dump(mode="json"),
        producer="test",
        correlation_id=str(alloc),
    )
    await js.publish(SUBJECT, env.model_dump_json().encode(), headers={"Nats-Msg-Id": env.event_id})
    return alloc, env.event_id


def test_every_declared_consumer_and_the_setting_default_to_a_short_ack_wait() -> None:
    assert ServiceSettings().consumer_ack_wait_s <= 5.0
    assert all(c.ack_wait_s <= 5.0 for c in CONSUMERS)
    assert node_agent_consumer("n1").ack_wait_s <= 5.0


async def test_a_handler_slower_than_the_ack_wait_is_not_redelivered_while_it_works(js, nats_server) -> None:
    spec = await _durable_at_end(js)
    bus_nc = await nats.connect(nats_server.url)
    bus = Bus(bus_nc, js, service="probe", schema=None, pool=None)
    deliveries: list[tuple[str, int]] = []
    finished = asyncio.Event()

    async def slow(ctx: HandlerContext) -> None:
        deliveries.append((ctx.envelope.event_id, ctx.num_delivered))
        # The work itself, and the behaviour under test: a handler that takes three and a half ack waits with no
        # ack but the bus's progress acks. Its duration is the input, not a wait for anything to happen.
        await asyncio.sleep(3.5 * ACK_WAIT_S)
        finished.set()

    bus.subscribe(spec, {"allocation.release_requested": slow}, transactional=False)
    await bus.start()
    try:
        _, event_id = await _publish_release(js)
        await asyncio.wait_for(finished.wait(), 30)

        async def acked() -> bool:
            info = await js.consumer_info(spec.stream, spec.durable)
            return info.num_ack_pending == 0 and info.delivered.stream_seq == info.ack_floor.stream_seq

        await eventually(acked, timeout=10, what="the message acked")
        info = await js.consumer_info(spec.stream, spec.durable)
        assert info.num_redelivered == 0
        assert deliveries == [(event_id, 1)]
    finally:
        await bus.stop()
        await bus_nc.close()


# A consumer process that takes the message and then works on it for good, until it is killed.
_WORKER = textwrap.dedent(
    """
    import asyncio, sys
    import nats
    from gpuaas_common.bus import Bus
    from gpuaas_common.jetstream import ConsumerSpec

    async def main(url, durable, ack_wait):
        nc = await nats.connect(url)
        bus = Bus(nc, nc.jetstream(), service="probe", schema=None, pool=None)
        spec = ConsumerSpec(durable, "ALLOCATIONS", "gpuaas.allocation.release_requested", max_deliver=5,
                            ack_wait_s=ack_wait)

        async def forever(ctx):
            print("WORKER", ctx.envelope.event_id, ctx.num_delivered, flush=True)
            await asyncio.Event().wait()

        bus.subscribe(spec, {"allocation.release_requested": forever}, transactional=False)
        await bus.start()
        print("WORKER ready", flush=True)
        await asyncio.Event().wait()

    asyncio.run(main(sys.argv[1], sys.argv[2], float(sys.argv[3])))
    """
)


async def _worker_says(worker: Any) -> list[str]:
    """The worker's next line of its own (faststream logs to the same stdout)."""
    while True:
        line = await worker.stdout.readline()
        if not line:
            raise EOFError("the worker exited")
        words = line.decode().split()
        if words[:1] == ["WORKER"]:
            return words[1:]


async def test_a_message_held_by_a_killed_consumer_is_redelivered_to_another(js, nats_server) -> None:
    spec = await _durable_at_end(js)
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUAAS_")}
    worker = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        _WORKER,
        nats_server.url,
        spec.durable,
        str(ACK_WAIT_S),
        stdout=subprocess.PIPE,
        env=env,
    )
    try:
        assert await asyncio.wait_for(_worker_says(worker), 60) == ["ready"]
        _, event_id = await _publish_release(js)
        assert await asyncio.wait_for(_worker_says(worker), 30) == [event_id, "1"]
    finally:
        if worker.returncode is None:
            os.kill(worker.pid, signal.SIGKILL)
        await worker.wait()

    bus_nc = await nats.connect(nats_server.url)
    bus = Bus(bus_nc, js, service="probe", schema=None, pool=None)
    deliveries: list[tuple[str, int]] = []

    async def record(ctx: HandlerContext) -> None:
        deliveries.append((ctx.envelope.event_id, ctx.num_delivered))

    bus.subscribe(spec, {"allocation.release_requested": record}, transactional=False)
    await bus.start()
    try:
        await eventually(lambda: deliveries, timeout=30, what="the redelivery")

        async def acked() -> bool:
            info = await js.consumer_info(spec.stream, spec.durable)
            return info.num_ack_pending == 0

        await eventually(acked, timeout=10, what="the redelivered message acked")
        assert deliveries == [(event_id, 2)]
    finally:
        await bus.stop()
        await bus_nc.close()
