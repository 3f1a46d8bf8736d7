"""ops-view applies a batch of allocation and node task events as a whole (adapters/projection.py's
BatchProjection: what the batch's allocations and tasks need read at once, the rows written at its end), against
a real Postgres and nats-server: the rows, usage records and outbox events are those that applying the same
messages one at a time makes, however the stream is cut into batches, with several events of one allocation in
one batch, events read out of order and repeats; and a batch holding a message that cannot be placed
dead-letters that one and commits the rest."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from types import SimpleNamespace
from typing import Any

import asyncpg
import nats
import pytest
from pydantic import BaseModel

from gpuaas_common.bus import Bus, parse_message
from gpuaas_common.contract import Envelope, spec_for
from gpuaas_common.contract import messages as m
from gpuaas_common.db import create_pool
from gpuaas_common.jetstream import FOLLOWERS, provision
from gpuaas_common.migrations import apply_migrations
from gpuaas_ops_view.adapters.projection import BatchProjection, Projection
from gpuaas_ops_view.entrypoints.follow import StreamFollower
from gpuaas_ops_view.service_layer.projection import Message, apply, apply_batch

from .test_ops_view import SCHEMA, _slot

STREAM = "ALLOCATIONS"
# Times off UTC and to the microsecond, and texts with quotes, a backslash and what looks like a parameter: the
# batch keeps what it read and what it wrote in memory, and must hand its statements what the reads give back.
T0 = datetime(2026, 11, 3, 9, 0, 0, 123456, tzinfo=timezone(timedelta(hours=1)))
ODD = "it's \\'late\\' $1 \\x00"
SHA = "c" * 64
# Every table the allocation stream's handlers write (and the scheduler's announcements of slots, which share the
# slots with the placements), and the outbox they publish through.
TABLES = (
    "allocations",
    "allocation_timeline",
    "claims",
    "slots",
    "hosts",
    "usage_records",
    "node_tasks",
    "node_task_phases",
    "stream_positions",
)


def stream_message(
    stream: str,
    seq: int,
    type_: str,
    payload: BaseModel,
    minute: float,
    producer: str,
    *,
    body: bytes | None = None,
    **params: str,
) -> Message:
    """One message as `stream` holds it at `seq`, `minute` after T0, checked against the contract (`body`, when
    given, stands for a broken one as it came)."""
    env = Envelope(
        event_id=str(uuid.uuid4()),
        type=type_,
        schema_version=1,
        occurred_at=T0 + timedelta(minutes=minute),
        correlation_id=str(uuid.uuid4()),
        producer=producer,
        payload=payload.model_dump(mode="json"),
    )
    subject = spec_for(type_).subject(**params)
    data = env.model_dump_json().encode() if body is None else body
    if body is None:
        parse_message(subject, data)
    return Message(stream, seq, subject, data)


@dataclass
class Stream:
    """Messages as the ALLOCATIONS stream holds them, numbered from 1."""

    messages: list[Message] = field(default_factory=list)

    def add(self, type_: str, payload: BaseModel, minute: int, *, body: bytes | None = None, **params: str) -> None:
        seq = len(self.messages) + 1
        self.messages.append(stream_message(STREAM, seq, type_, payload, minute, "allocator", body=body, **params))

    def move(self, alloc: uuid.UUID, state: str, seq: int, minute: int, *, mode: str = "slots", **extra: Any) -> None:
        node = f"n-{alloc.hex[:8]}"
        image = m.ImageRef(slug="debian-12", digest_sha256=SHA, image_path="/i/debian-12.raw")
        slots = [_slot(node, 1), _slot(node, 2)] if mode == "slots" else []
        fields: dict[str, Any] = {
            "accepted": {"sku": "h200-sxm-slice", "gpu_count": 2, "region": "default", "image": image},
            "placed": {"node_id": node, "claim_mode": mode, "slots": slots},
            "unschedulable": {"reason_code": "no_capacity", "reason": "full", "free_gpus": 0, "requested_gpus": 2},
            "provisioning": {"node_id": node, "task_id": f"t-{alloc.hex[:12]}"},
            "active": {"node_id": node, "access": m.AccessInfo(ip="10.100.0.11", ssh_ready=True)},
            "releasing": {"reason": ODD},
            "released": {"node_id": node, "cleanup": m.CleanupReport(required=True, verified=True)},
            "failed": {
                "reason_code": "task_deadline_passed",
                "reason": ODD,
                "node_id": node,
                "cleanup_required": True,
            },
        }[state]
        model = spec_for(f"allocation.{state}").model
        payload = model(
            allocation_id=alloc, tenant_id="acme", shape="gpu_slice", state=state, seq=seq, **{**fields, **extra}
        )
        self.add(f"allocation.{state}", payload, minute)

    def walk(self, alloc: uuid.UUID, *states: str, start: int = 0) -> None:
        for i, state in enumerate(states):
            self.move(alloc, state, i + 1, start + i)

    def announce(self, alloc: uuid.UUID, generation: int, minute: int, **slots: tuple[str, str]) -> None:
        """The scheduler's announcement of the slots of the allocation's host: slot -> (status, health)."""
        node = f"n-{alloc.hex[:8]}"
        states = [
            m.SlotState(
                slot_id=f"{node}-{slot}",
                status=status,  # type: ignore[arg-type]
                status_reason=ODD if status != "available" else None,
                health_state=health,  # type: ignore[arg-type]
                health_detail=ODD if health != "healthy" else None,
                profile="h200_1g",
                gpu_pci_address="0000:18:00.0",
                nvme_by_id=f"/dev/disk/by-id/nvme-{slot}",
                updated_at=T0 + timedelta(minutes=minute),
            )
            for slot, (status, health) in sorted(slots.items())
        ]
        change = m.SlotsChanged(node_id=node, generation=generation, cause="release", actor="scheduler", slots=states)
        self.add("scheduler.slots_changed", change, minute)

    def again(self) -> None:
        """The last message once more, as a redelivery or a replay brings it."""
        last = self.messages[-1]
        self.messages.append(Message(STREAM, len(self.messages) + 1, last.subject, last.data))


def scenario() -> Stream:
    """Allocations whose events share batches: whole lifecycles, a failure while active, an unschedulable, a
    reject, a repeat, and events read out of their seq order (an older after a newer; a release before the
    placement, so the claims it ended come after it)."""
    s = Stream()
    released, failed, unschedulable, older, early_end, exclusive = (uuid.uuid4() for _ in range(6))
    s.walk(released, "accepted", "placed", "provisioning", "active")
    # The host's slots announced, one never placed among them; again (a repeat); an older one read after it.
    s.announce(released, 2, 2, s1=("active", "healthy"), s2=("active", "healthy"), s3=("disabled", "healthy"))
    s.again()
    s.announce(released, 1, 1, s1=("available", "healthy"), s9=("retired", "unknown"))
    s.move(released, "active", 4, 3)  # the same transition again: a repeat
    s.walk(failed, "accepted", "placed", "provisioning", "active", start=1)
    s.move(released, "releasing", 5, 30)
    s.move(released, "released", 6, 31)
    # The scheduler refused one disk's proof: that slot blocked and failed.
    s.announce(
        released, 3, 32, s1=("cleanup_blocked", "failed"), s2=("available", "healthy"), s3=("disabled", "healthy")
    )
    s.move(failed, "failed", 5, 45)
    s.walk(unschedulable, "accepted", "unschedulable")
    s.move(older, "placed", 2, 5)
    s.move(older, "accepted", 1, 4)
    s.move(early_end, "accepted", 1, 0)
    s.move(early_end, "released", 6, 50)
    # Announced before its placement is read: the placement then only fills what the announcement left unknown.
    s.announce(early_end, 1, 51, s1=("cleanup_blocked", "failed"))
    s.move(early_end, "placed", 2, 1)
    s.walk(exclusive, "accepted")
    s.move(exclusive, "placed", 2, 1, mode="node_exclusive")
    s.add(
        "allocation.rejected",
        m.AllocationRejected(allocation_id=uuid.uuid4(), tenant_id="acme", reason_code="quota", reason="over"),
        2,
    )
    return s


def tasks(s: Stream) -> Stream:
    """Node tasks as the task and report streams carry them, read together: a task sent, its progress and
    result; a result read before its task was sent and before a late progress report (a result wins)."""
    node = "n-tasks"
    for t, (first, then) in enumerate((("sent", "reported"), ("reported", "sent"))):
        alloc, task = uuid.uuid4(), f"t-{uuid.uuid4().hex[:12]}"
        sent = m.SliceVmProvision(
            task_id=task,
            allocation_id=alloc,
            node_id=node,
            fencing_epoch=1,
            deadline=T0 + timedelta(minutes=10),
            vm_name=f"vm-{t}",
            slots=[_slot(node, 1)],
            image=m.ImageRef(slug="debian-12", digest_sha256=SHA, image_path="/i/debian-12.raw"),
            hostname="box",
        )
        common = {"task_id": task, "allocation_id": alloc, "node_id": node, "task_type": "slice.vm_provision"}
        for step in (first, then):
            if step == "sent":
                s.add("slice.vm_provision", sent, t, node_id=node)
                continue
            s.add("node.task_progress", m.NodeTaskProgress(**common, phase="clone"), t + 1, node_id=node)
            s.add("node.task_result", m.NodeTaskResult(**common, status="succeeded"), t + 2, node_id=node)
            s.add("node.task_progress", m.NodeTaskProgress(**common, phase="boot"), t + 1, node_id=node)
    return s


@pytest.fixture
async def pool(fresh_db: str) -> AsyncIterator[asyncpg.Pool]:
    conn = await asyncpg.connect(fresh_db)
    await apply_migrations(conn, SCHEMA, "gpuaas_ops_view.migrations")
    await conn.close()
    p = await create_pool(fresh_db, SCHEMA)
    yield p
    await p.close()


async def one_at_a_time(pool: asyncpg.Pool, messages: list[Message]) -> None:
    for message in messages:
        async with pool.acquire() as conn, conn.transaction():
            await apply(Projection(conn), message)


async def in_batches(pool: asyncpg.Pool, messages: list[Message], size: int) -> None:
    for i in range(0, len(messages), size):
        async with pool.acquire() as conn, conn.transaction():
            await apply_batch(BatchProjection(conn), messages[i : i + size])


async def dump(pool: asyncpg.Pool, *, clear: bool = False) -> dict[str, list[tuple[str, ...]]]:
    """The rows, and with `clear` none left after."""
    out: dict[str, list[tuple[str, ...]]] = {}
    async with pool.acquire() as conn:
        for table in TABLES:
            out[table] = sorted(tuple(str(v) for v in r.values()) for r in await conn.fetch(f"SELECT * FROM {table}"))
        # An event as the relay would publish it, less the moment it was raised.
        out["outbox"] = [
            (r["event_id"], r["aggregate_id"], r["subject"], json.dumps(json.loads(r["body"])["payload"]))
            for r in await conn.fetch("SELECT event_id, aggregate_id, subject, body FROM outbox ORDER BY id")
        ]
        if clear:
            await conn.execute(f"TRUNCATE {', '.join(TABLES)}, outbox")
    return out


async def test_a_batch_writes_the_rows_one_at_a_time_writes(pool: asyncpg.Pool) -> None:
    messages = tasks(scenario()).messages
    await one_at_a_time(pool, messages)
    alone = await dump(pool, clear=True)
    assert len(alone["usage_records"]) == 2 and len(alone["outbox"]) == 2
    assert {r[3] for r in alone["allocations"]} == {"released", "failed", "unschedulable", "placed", "rejected"}
    # The release read before the placement ended no claim: the placement's are live, as one by one.
    assert sum(r[5] == "None" for r in alone["claims"]) == 5
    assert {r[6] for r in alone["node_tasks"]} == {"succeeded"} and len(alone["node_task_phases"]) == 4
    # The announced slots (status, health, announcement number): each host's newest, nothing of the older (no s9).
    announced = sorted((r[7], r[9], r[11]) for r in alone["slots"] if r[11] != "None")
    assert announced == [
        ("available", "healthy", "3"),
        ("cleanup_blocked", "failed", "1"),
        ("cleanup_blocked", "failed", "3"),
        ("disabled", "healthy", "3"),
    ]
    assert len(alone["hosts"]) == 2 and not any(r[1].endswith("-s9") for r in alone["slots"])
    for size in (len(messages), 4, 3):
        await in_batches(pool, messages, size)
        assert await dump(pool, clear=True) == alone, f"batches of {size}"


async def test_a_batch_read_again_changes_nothing(pool: asyncpg.Pool) -> None:
    """A replay or a redelivery: every event of the batch is a repeat, and no usage record closes twice."""
    messages = tasks(scenario()).messages
    await in_batches(pool, messages, len(messages))
    async with pool.acquire() as conn:
        await conn.execute("DELETE FROM outbox")
    first = await dump(pool)
    await in_batches(pool, messages, len(messages))
    await in_batches(pool, messages, len(messages))
    again = await dump(pool)
    assert again["outbox"] == []
    assert again == {**first, "outbox": []}


@pytest.fixture
async def nc(nats_server: Any) -> AsyncIterator[nats.NATS]:
    client = await nats.connect(nats_server.url)
    await provision(client.jetstream())
    yield client
    await client.drain()


def _msg(message: Message) -> Any:
    """A message as the follower's pull hands it over: its place in the stream and in its consumer."""
    seq = SimpleNamespace(stream=message.seq, consumer=message.seq)
    return SimpleNamespace(
        subject=message.subject,
        data=message.data,
        headers=None,
        metadata=SimpleNamespace(sequence=seq, timestamp=T0, num_delivered=1),
    )


def _follower(nc: nats.NATS, pool: asyncpg.Pool) -> StreamFollower:
    js = nc.jetstream()
    [spec] = [s for s in FOLLOWERS if s.stream == STREAM]
    letters = Bus(nc, js, service="ops-view", schema=None, pool=None)
    name = spec.durable.replace("ops-view", f"ob-{uuid.uuid4().hex[:8]}", 1)
    return StreamFollower(nc, js, pool, spec, name=name, dead_letters=letters, batch=64)


async def test_one_unplaceable_message_is_dead_lettered_and_the_rest_of_its_batch_commits(
    nc: nats.NATS, pool: asyncpg.Pool
) -> None:
    s = Stream()
    alloc, other = uuid.uuid4(), uuid.uuid4()
    s.walk(alloc, "accepted", "placed")
    s.move(alloc, "failed", 2, 3)  # seq 2 again, another state: a broken history
    s.add("allocation.active", m.AllocationRejected(allocation_id=alloc, reason_code="x", reason="x"), 4, body=b"{no")
    s.move(alloc, "provisioning", 3, 5)
    s.walk(other, "accepted", "placed", "provisioning", "active", "releasing", "released")
    follower = _follower(nc, pool)
    dlq = await nc.jetstream().subscribe(f"gpuaas.dlq.{follower.spec.durable}", ordered_consumer=True)

    await follower._apply([_msg(message) for message in s.messages])

    assert follower.position == len(s.messages)
    async with pool.acquire() as conn:
        timeline = await conn.fetch(
            "SELECT state FROM allocation_timeline WHERE allocation_id = $1 ORDER BY seq", alloc
        )
        assert [r["state"] for r in timeline] == ["accepted", "placed", "provisioning"]
        assert await conn.fetchval("SELECT state FROM allocations WHERE allocation_id = $1", alloc) == "provisioning"
        usage = await conn.fetchrow("SELECT * FROM usage_records WHERE allocation_id = $1", other)
        assert usage["ended"] == "released" and usage["stopped_at"] - usage["started_at"] == timedelta(minutes=2)
        assert await conn.fetchval("SELECT count(*) FROM outbox WHERE aggregate_id = $1", str(other)) == 1
        assert await conn.fetchval("SELECT last_seq FROM stream_positions WHERE stream = $1", STREAM) == len(s.messages)
    letters = []
    for _ in range(2):
        msg = await dlq.next_msg(timeout=10)
        letters.append(parse_message(msg.subject, msg.data)[1])
    await dlq.unsubscribe()
    assert {(d.reason_code, d.stream_seq) for d in letters} == {("unplaceable", 3), ("not_json", 4)}  # type: ignore[attr-defined]


async def test_a_repeat_in_a_batch_is_applied_with_the_batch(nc: nats.NATS, pool: asyncpg.Pool) -> None:
    """Not a failure that sends the batch one message at a time: the batch commits as a whole."""
    s = Stream()
    alloc = uuid.uuid4()
    s.walk(alloc, "accepted", "placed", "provisioning", "active")
    s.move(alloc, "active", 4, 3)
    s.move(alloc, "placed", 2, 1)
    follower = _follower(nc, pool)
    assert await follower._apply_batch([_msg(message) for message in s.messages], alone=False) == []
    async with pool.acquire() as conn:
        assert await conn.fetchval("SELECT count(*) FROM allocation_timeline WHERE allocation_id = $1", alloc) == 4
        assert await conn.fetchval("SELECT count(*) FROM usage_records WHERE allocation_id = $1", alloc) == 1
