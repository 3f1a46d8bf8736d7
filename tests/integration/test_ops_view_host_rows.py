"""ops-view caps the tables a host's messages grow (node tasks, their phases, dead letters: adapters/host_rows.py)
per host in the transaction that inserts them, over a real Postgres and nats-server: a host (or a consumer
dead-lettering) sending more than the cap leaves at most the cap's worth right after each batch's commit, its
newest, whatever the hourly sweep has not yet done; another host's rows are untouched. The live followers hold it
too, sampled at each of their commits."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import asyncpg
import nats
from pydantic import BaseModel

from gpuaas_common.bus import Bus, parse_message
from gpuaas_common.contract import messages as m
from gpuaas_common.jetstream import FOLLOWERS
from gpuaas_dev.testing.waiting import eventually
from gpuaas_ops_view.adapters.projection import CHANGED_CHANNEL
from gpuaas_ops_view.entrypoints.follow import StreamFollower

from ..bounded import bounded
from .test_ops_view import publish
from .test_ops_view_batches import _msg, nc, pool, stream_message  # noqa: F401  (fixtures)

CAP = 5


def _follower(nc_: nats.NATS, pool_: asyncpg.Pool, stream: str, *, cap: int = CAP) -> StreamFollower:
    js = nc_.jetstream()
    [spec] = [s for s in FOLLOWERS if s.stream == stream]
    letters = Bus(nc_, js, service="ops-view", schema=None, pool=None)
    name = spec.durable.replace("ops-view", f"hr-{uuid.uuid4().hex[:8]}", 1)
    return StreamFollower(nc_, js, pool_, spec, name=name, dead_letters=letters, batch=64, host_rows_per_node=cap)


class Feed:
    """Messages of one stream as it numbers them, each checked against the contract; `minute` is its time."""

    def __init__(self, stream: str) -> None:
        self.stream = stream
        self.seq = 0

    def message(self, type_: str, payload: BaseModel, minute: float, *, body: bytes | None = None, **params: str):
        self.seq += 1
        return _msg(stream_message(self.stream, self.seq, type_, payload, minute, "test", body=body, **params))


def _progress(node: str, task: str) -> m.NodeTaskProgress:
    return m.NodeTaskProgress(
        task_id=task, allocation_id=uuid.uuid4(), node_id=node, task_type="slice.vm_provision", phase="boot"
    )


def _letter(consumer: str, i: int) -> m.DeadLetter:
    return m.DeadLetter(
        consumer=consumer,
        stream="NODE_REPORTS",
        subject=f"gpuaas.node.n{i}.report.drift",
        stream_seq=i,
        reason_code="schema_invalid",
        reason=f"bad report {i}",
    )


async def _rows(pool_: asyncpg.Pool) -> dict[str, dict[str, list[Any]]]:
    """Per table, each group's rows (tasks by id, phases by stream seq, letters by DLQ seq), oldest first."""
    async with pool_.acquire() as conn:
        queries = {
            "node_tasks": "SELECT node_id, task_id FROM node_tasks ORDER BY updated_at, task_id",
            "node_task_phases": "SELECT node_id, stream_seq FROM node_task_phases ORDER BY at, stream_seq",
            "dead_letters": "SELECT consumer, dlq_seq FROM dead_letters ORDER BY at, dlq_seq",
        }
        out: dict[str, dict[str, list[Any]]] = {}
        for table, sql in queries.items():
            groups: dict[str, list[Any]] = {}
            for group, key in await conn.fetch(sql):
                groups.setdefault(group, []).append(key)
            out[table] = groups
    return out


async def test_a_flooding_hosts_tasks_and_phases_stay_at_the_cap_after_each_batch(nc, pool) -> None:  # noqa: F811
    """Each report names a task of its own (a host inventing them): every one makes a task row and a phase row.
    Four batches of 4 from `flood`, after 3 from `quiet`: after each commit flood holds at most the cap, its
    newest; quiet's rows stay as they were."""
    follower = _follower(nc, pool, "NODE_REPORTS")
    feed = Feed("NODE_REPORTS")
    quiet = [feed.message("node.task_progress", _progress("quiet", f"q-{i}"), i, node_id="quiet") for i in range(3)]
    await follower._apply(quiet)
    sent: list[tuple[str, int]] = []  # flood's (task, stream seq), oldest first
    for batch in range(4):
        msgs = []
        for i in range(4):
            task = f"f-{batch}-{i}"
            minute = 10 + 4 * batch + i
            msgs.append(feed.message("node.task_progress", _progress("flood", task), minute, node_id="flood"))
            sent.append((task, feed.seq))
        await follower._apply(msgs)
        rows = await _rows(pool)
        newest = sent[-CAP:]
        assert rows["node_tasks"]["flood"] == [task for task, _ in newest], f"after batch {batch}"
        assert rows["node_task_phases"]["flood"] == [seq for _, seq in newest], f"after batch {batch}"
        assert rows["node_tasks"]["quiet"] == ["q-0", "q-1", "q-2"]
        assert rows["node_task_phases"]["quiet"] == [1, 2, 3]
    assert follower.position == feed.seq


async def test_the_cap_holds_when_a_batch_is_applied_one_message_at_a_time(nc, pool) -> None:  # noqa: F811
    """A batch holding one message that cannot be placed is applied again message by message, in savepoints: the
    cap holds there too, and the unplaceable one's group gains nothing."""
    follower = _follower(nc, pool, "NODE_REPORTS")
    feed = Feed("NODE_REPORTS")
    msgs, phases = [], []
    for i in range(9):
        if i == 4:
            msgs.append(feed.message("node.task_progress", _progress("flood", "x"), i, body=b"{no", node_id="flood"))
            continue
        msgs.append(feed.message("node.task_progress", _progress("flood", f"f-{i}"), i, node_id="flood"))
        phases.append(feed.seq)
    dlq = await nc.jetstream().subscribe(f"gpuaas.dlq.{follower.spec.durable}", ordered_consumer=True)
    try:
        await follower._apply(msgs)
        letter = await dlq.next_msg(timeout=10)
    finally:
        await dlq.unsubscribe()
    assert parse_message(letter.subject, letter.data)[1].reason_code == "not_json"
    rows = await _rows(pool)
    assert rows["node_tasks"]["flood"] == ["f-3", "f-5", "f-6", "f-7", "f-8"]
    assert rows["node_task_phases"]["flood"] == phases[-CAP:] == [4, 6, 7, 8, 9]


async def test_a_consumers_dead_letters_stay_at_the_cap_after_each_batch(nc, pool) -> None:  # noqa: F811
    """A service dead-lettering a flooding host's reports: its letters capped, another consumer's untouched."""
    follower = _follower(nc, pool, "DLQ")
    feed = Feed("DLQ")
    other = [
        feed.message("dead_letter", _letter("allocator-requested", i), i, consumer="allocator-requested")
        for i in range(2)
    ]
    await follower._apply(other)
    flooded = "scheduler-node-drift"
    seqs: list[int] = []
    for batch in range(3):
        msgs = []
        for i in range(6):
            msgs.append(feed.message("dead_letter", _letter(flooded, i), 10 + 6 * batch + i, consumer=flooded))
            seqs.append(feed.seq)
        await follower._apply(msgs)
        letters = (await _rows(pool))["dead_letters"]
        assert letters[flooded] == seqs[-CAP:], f"after batch {batch}"
        assert letters["allocator-requested"] == [1, 2]


async def test_the_live_followers_hold_the_cap_at_every_commit(nc, pool) -> None:  # noqa: F811
    """Over the real streams: the followers read what a flooding host sent, and at each of their commits (the
    models' change notice) the host holds at most the cap; at the end its newest, and the other host all of its."""
    flood, quiet = f"fl-{uuid.uuid4().hex[:6]}", f"qu-{uuid.uuid4().hex[:6]}"
    followers = [_follower(nc, pool, stream) for stream in ("NODE_TASKS", "NODE_REPORTS")]
    seen: list[int] = []
    commits: asyncio.Queue[str] = asyncio.Queue()
    listener = await pool.acquire()

    def committed(_conn: Any, _pid: int, _channel: str, stream: str) -> None:
        commits.put_nowait(stream)

    await listener.add_listener(CHANGED_CHANNEL, committed)

    async def sample() -> None:
        async with pool.acquire() as conn:
            while True:
                await commits.get()
                seen.append(
                    await conn.fetchval(
                        "SELECT GREATEST((SELECT count(*) FROM node_tasks WHERE node_id = $1), "
                        "(SELECT count(*) FROM node_task_phases WHERE node_id = $1))",
                        flood,
                    )
                )

    tasks = [asyncio.create_task(f.run()) for f in followers] + [asyncio.create_task(sample())]
    try:
        for i in range(2):
            await publish(nc, "node.task_progress", _progress(quiet, f"{quiet}-{i}"), node_id=quiet)
        for i in range(40):
            await publish(nc, "node.task_progress", _progress(flood, f"{flood}-{i:02}"), node_id=flood)
        last = (await nc.jetstream().stream_info("NODE_REPORTS")).state.last_seq
        await eventually(lambda: followers[1].position >= last, 20, what="the reports followed")
        await eventually(lambda: commits.empty(), 10, what="every commit sampled")
    finally:
        for task in tasks:
            task.cancel()
        await bounded("the followers stop", asyncio.gather(*tasks, return_exceptions=True))
        await listener.remove_listener(CHANGED_CHANNEL, committed)
        await pool.release(listener)
    assert seen and max(seen) <= CAP, seen
    rows = await _rows(pool)
    assert rows["node_tasks"][flood] == [f"{flood}-{i:02}" for i in range(40 - CAP, 40)]
    assert len(rows["node_task_phases"][flood]) == CAP
    assert rows["node_tasks"][quiet] == [f"{quiet}-0", f"{quiet}-1"]
    assert len(rows["node_task_phases"][quiet]) == 2


async def test_a_host_reporting_another_hosts_task_changes_nothing_of_it(nc, pool) -> None:  # noqa: F811
    """A task is its node's: `intruder`'s report naming `owner`'s task id (the subject is the intruder's own, as
    its identity allows) neither moves the task nor adds a phase to it; the intruder's own report still lands."""
    follower = _follower(nc, pool, "NODE_REPORTS")
    feed = Feed("NODE_REPORTS")
    await follower._apply([feed.message("node.task_progress", _progress("owner", "t-owned"), 0, node_id="owner")])
    before = await pool.fetchrow("SELECT node_id, status, updated_at FROM node_tasks WHERE task_id = 't-owned'")
    forged = m.NodeTaskResult(
        task_id="t-owned",
        allocation_id=uuid.uuid4(),
        node_id="intruder",
        task_type="slice.vm_provision",
        status="succeeded",
        disk_touched=False,
    )
    await follower._apply(
        [
            feed.message("node.task_progress", _progress("intruder", "t-owned"), 1, node_id="intruder"),
            feed.message("node.task_result", forged, 2, node_id="intruder"),
            feed.message("node.task_progress", _progress("intruder", "t-own"), 3, node_id="intruder"),
        ]
    )
    after = await pool.fetchrow("SELECT node_id, status, updated_at FROM node_tasks WHERE task_id = 't-owned'")
    assert dict(after) == dict(before)
    phases = await pool.fetch("SELECT node_id FROM node_task_phases WHERE task_id = 't-owned'")
    assert [p["node_id"] for p in phases] == ["owner"]
    rows = await _rows(pool)
    assert rows["node_tasks"]["intruder"] == ["t-own"]
    assert follower.position == feed.seq
