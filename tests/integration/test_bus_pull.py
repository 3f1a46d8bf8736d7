"""The bus's pull loop on a real nats-server: a backlog comes in batches, a lone message waits for no batch,
no more messages are in hand than there are places, and a request the server lost (it restarted) is asked
again."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import nats
import nats.errors
import nats.js.errors
import pytest

from gpuaas_common.bus import Bus
from gpuaas_common.contract import Envelope
from gpuaas_common.contract import messages as m
from gpuaas_common.jetstream import ConsumerSpec, provision
from gpuaas_common.pull import PullLoop
from gpuaas_dev.testing.durables import durable_at_end
from gpuaas_dev.testing.servers import NatsServer
from gpuaas_dev.testing.waiting import eventually

SUBJECT = "gpuaas.allocation.release_requested"


def _body(reason: str) -> bytes:
    payload = m.AllocationReleaseRequested(allocation_id=uuid.uuid4(), reason=reason).model_dump(mode="json")
    env = Envelope.wrap("allocation.release_requested", payload, producer="test", correlation_id="c")
    return env.model_dump_json().encode()


class _Hands:
    """A `start` that acks each message at once, or holds it until `release()` (and counts what it holds)."""

    def __init__(self, hold: bool = False) -> None:
        self.hold = hold
        self.seen: list[bytes] = []
        self.held: list[tuple[Any, Any]] = []
        self.most_in_hand = 0
        self._in_hand = 0
        self._tasks: set[asyncio.Task[None]] = set()

    def start(self, msg: Any, done: Any) -> None:
        self.seen.append(msg.data)
        self._in_hand += 1
        self.most_in_hand = max(self.most_in_hand, self._in_hand)
        if self.hold:
            self.held.append((msg, done))
            return
        task = asyncio.create_task(self._ack(msg, done))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _ack(self, msg: Any, done: Any) -> None:
        await msg.ack()
        self._in_hand -= 1
        done()

    async def release(self) -> None:
        self.hold = False
        held, self.held = self.held, []
        for msg, done in held:
            await self._ack(msg, done)


async def _running(loop: PullLoop) -> asyncio.Task[None]:
    return asyncio.create_task(loop.run())


async def _stop(task: asyncio.Task[None]) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def test_a_backlog_comes_in_batches_not_one_request_per_message(js, nats_server) -> None:
    spec = await durable_at_end(js, "pull-backlog", SUBJECT)
    for i in range(64):
        await js.publish(SUBJECT, _body(str(i)))
    hands = _Hands()
    consumer = await nats.connect(nats_server.url)
    loop = PullLoop(consumer, spec, hands.start, places=16)
    task = await _running(loop)
    try:
        await eventually(lambda: len(hands.seen) == 64, timeout=30, what="the backlog handled")
    finally:
        await _stop(task)
        await consumer.close()
    # Four full batches, and a few more while places were still being freed; far from one per message.
    assert loop.requests <= 16, loop.requests
    assert hands.most_in_hand <= 16


async def test_a_lone_message_is_started_at_once_not_when_its_request_expires(js, nats_server) -> None:
    spec = await durable_at_end(js, "pull-lone", SUBJECT)
    hands = _Hands()
    consumer = await nats.connect(nats_server.url)
    # The open request asks for 8 and lives 60 s: a loop that waited for the batch would take a minute.
    loop = PullLoop(consumer, spec, hands.start, places=8, expires_s=60.0)
    task = await _running(loop)
    try:
        await eventually(lambda: loop.requests == 1, timeout=10, what="the request open")
        await js.publish(SUBJECT, _body("lone"))
        await eventually(lambda: len(hands.seen) == 1, timeout=10, what="the lone message started")
        assert loop.requests == 1  # started from the open request, none asked for it
    finally:
        await _stop(task)
        await consumer.close()


async def test_never_more_messages_in_hand_than_places(js, nats_server) -> None:
    spec = await durable_at_end(js, "pull-places", SUBJECT)
    for i in range(20):
        await js.publish(SUBJECT, _body(str(i)))
    hands = _Hands(hold=True)
    consumer = await nats.connect(nats_server.url)
    loop = PullLoop(consumer, spec, hands.start, places=5, expires_s=0.3)
    task = await _running(loop)
    try:
        await eventually(lambda: len(hands.held) == 5, timeout=10, what="five in hand")
        # Requests keep expiring while every place is taken; none asks for more.
        requests = loop.requests
        await eventually(lambda: loop.requests == requests, timeout=2, what="no new request")
        assert len(hands.seen) == 5
        for _ in range(3):
            await hands.release()
            await eventually(lambda: len(hands.seen) >= 20 or len(hands.held) == 5, timeout=10, what="refilled")
        await hands.release()
        await eventually(lambda: len(hands.seen) == 20, timeout=10, what="all twenty")
    finally:
        await _stop(task)
        await consumer.close()
    assert hands.most_in_hand == 5


async def test_a_late_answer_to_an_earlier_request_does_not_end_the_open_one(js, nats_server) -> None:
    """The server ends a request (408 expired, 409 refused) on that request's reply subject. An end that comes
    late, after the loop had already given that request up and asked again, must not end the request now open:
    the loop would ask once more while the open one still stands on the server, and both could deliver."""
    spec = await durable_at_end(js, "pull-late-end", SUBJECT)
    hands = _Hands()
    consumer = await nats.connect(nats_server.url)
    # Two places: the one message leaves the request open (filling it would rightly send the next).
    loop = PullLoop(consumer, spec, hands.start, places=2, expires_s=60.0)
    task = await _running(loop)
    sender = await nats.connect(nats_server.url)
    expired = {"Status": "408", "Description": "Request Timeout"}
    try:
        await eventually(lambda: loop.requests == 1, timeout=10, what="the request open")
        # A 408 on the subject of a request before this one: a leftover, ignored.
        await sender.publish(f"{loop.reply_prefix}.0", b"", headers=expired)
        await sender.flush()
        await js.publish(SUBJECT, _body("after the late end"))
        await eventually(lambda: len(hands.seen) == 1, timeout=10, what="the message started")
        assert loop.requests == 1  # still the first request: the leftover ended nothing
        # The same answer on the open request's subject does end it (so the leftover was read as a status).
        await sender.publish(f"{loop.reply_prefix}.1", b"", headers=expired)
        await sender.flush()
        await eventually(lambda: loop.requests == 2, timeout=10, what="a new request after the real end")
    finally:
        await _stop(task)
        await sender.close()
        await consumer.close()


async def test_a_request_the_killed_server_lost_is_asked_again(tmp_path) -> None:
    # Every write synced before its PubAck: what the kill must lose is the open pull request, not the stream's
    # last writes. With the default cadence `after` sometimes never came after the restart (1 run in 9 beside
    # two others, three fresh-clone CI runs; 0 in 12 with every write synced). Not confirmed, the suspect: a
    # kill that loses the stream's last write while the durable's state keeps it, so that `after` takes a
    # sequence the durable counts as delivered.
    server = NatsServer(tmp_path / "nats", sync_interval="always").start()
    admin = await nats.connect(server.url, max_reconnect_attempts=-1, reconnect_time_wait=0.1)
    consumer = await nats.connect(server.url, max_reconnect_attempts=-1, reconnect_time_wait=0.1)
    task = None
    try:
        js = admin.jetstream()
        await provision(js)
        spec = await durable_at_end(js, "pull-restart", SUBJECT)
        hands = _Hands()
        loop = PullLoop(consumer, spec, hands.start, places=4, expires_s=1.0)
        task = await _running(loop)
        await js.publish(SUBJECT, _body("before"))
        await eventually(lambda: len(hands.seen) == 1, timeout=10, what="the first message")
        server.kill()  # the open request dies with it, unanswered
        server.start()
        await eventually(lambda: consumer.is_connected and admin.is_connected, timeout=30, what="reconnected")
        after = _body("after")

        async def published() -> bool:
            try:
                await js.publish(SUBJECT, after, timeout=2, headers={"Nats-Msg-Id": "after"})
            except nats.errors.Error:
                return False  # JetStream still recovering its streams
            return True

        await eventually(published, timeout=30, what="a publish after the restart")
        # Asked again: the loop re-asks every 1.25 s. The bound is a liveness check, not a timing goal; `before`
        # may come again too (its ack can die with the server), so the wait is for `after` itself.
        await eventually(lambda: after in hands.seen, timeout=60, what="the message after the restart")
    finally:
        if task is not None:
            await _stop(task)
        await consumer.close()
        await admin.close()
        server.stop()


async def test_a_bus_started_on_a_durable_nobody_created_fails_at_start(js, nats_server) -> None:
    consumer = await nats.connect(nats_server.url)
    bus = Bus(consumer, js, service="probe", schema=None, pool=None)
    bus.subscribe(ConsumerSpec("nobody-made-me", "ALLOCATIONS", SUBJECT), {}, transactional=False)
    try:
        with pytest.raises(nats.js.errors.NotFoundError):
            await bus.start()
    finally:
        await bus.stop()
        await consumer.close()
