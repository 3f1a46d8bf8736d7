"""Keyed concurrency on a real nats-server: a durable works on many messages at once, in order per aggregate,
so one stuck allocation never holds up the others."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import nats
import pytest

from gpuaas_common.bus import Bus, HandlerContext, KeyedLanes, ordering_key
from gpuaas_common.contract import Envelope
from gpuaas_common.contract import messages as m
from gpuaas_dev.testing.durables import durable_at_end
from gpuaas_dev.testing.waiting import eventually

SUBJECT = "gpuaas.allocation.release_requested"


def _body(alloc: uuid.UUID, reason: str) -> bytes:
    payload = m.AllocationReleaseRequested(allocation_id=alloc, reason=reason).model_dump(mode="json")
    env = Envelope.wrap("allocation.release_requested", payload, producer="test", correlation_id=str(alloc))
    return env.model_dump_json().encode()


@pytest.mark.parametrize(
    ("body", "key"),
    [
        (b'{"payload": {"allocation_id": "a1", "node_id": "n1"}}', "allocation_id:a1"),
        (b'{"payload": {"node_id": "n1"}}', "node_id:n1"),
        (b'{"payload": {"slug": "img", "node_id": "n1"}}', "slug:img"),
        (b'{"payload": {"allocation_id": ""}}', "subject:s"),
        (b'{"payload": {}}', "subject:s"),
        (b"[]", "<unparseable>"),
        (b"\xff", "<unparseable>"),
        (b"not json", "<unparseable>"),
    ],
)
def test_ordering_key_names_the_aggregate(body: bytes, key: str) -> None:
    assert ordering_key("s", body) == key


async def test_lanes_release_each_key_in_entry_order_and_forget_drained_keys() -> None:
    lanes = KeyedLanes()
    first, done_a1 = lanes.enter("a")
    second, done_a2 = lanes.enter("a")
    other, done_b = lanes.enter("b")
    assert first is None and other is None and second is not None
    assert not second.done()
    done_a1()
    assert second.done()
    done_a2()
    done_b()
    assert len(lanes) == 0


async def test_a_stuck_allocation_holds_up_only_itself_and_each_allocation_keeps_its_order(js, nats_server) -> None:
    spec = await durable_at_end(js, "keyed", SUBJECT)
    stuck, free = uuid.uuid4(), [uuid.uuid4() for _ in range(5)]
    unblock = asyncio.Event()
    handled: list[tuple[str, str]] = []

    async def handle(ctx: HandlerContext) -> None:
        payload: Any = ctx.payload
        if payload.allocation_id == stuck and payload.reason == "0":
            await unblock.wait()
        handled.append((str(payload.allocation_id), payload.reason))

    bus_nc = await nats.connect(nats_server.url)
    bus = Bus(bus_nc, js, service="probe", schema=None, pool=None, default_concurrency=8)
    bus.subscribe(
        spec,
        {"allocation.release_requested": handle},
        transactional=False,
    )
    await bus.start()
    try:
        for i in range(3):
            await js.publish(SUBJECT, _body(stuck, str(i)))
        for i in range(3):
            for alloc in free:
                await js.publish(SUBJECT, _body(alloc, str(i)))
        # Every other allocation finishes while the first one is stuck in its handler.
        await eventually(lambda: len(handled) == 3 * len(free), timeout=30, what="the other allocations handled")
        assert all(a != str(stuck) for a, _ in handled)
        unblock.set()
        await eventually(lambda: len(handled) == 3 * (len(free) + 1), timeout=30, what="the stuck one handled")
        for alloc in [stuck, *free]:
            assert [r for a, r in handled if a == str(alloc)] == ["0", "1", "2"], f"order kept for {alloc}"
    finally:
        unblock.set()
        await bus.stop()
        await bus_nc.close()
