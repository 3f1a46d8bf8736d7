"""The allocator's repository writes behind: a state change, a timeline row or a column update is sent with
the next statement or the COMMIT. Whatever is sent when, a read in the same unit of work sees every earlier
write, the timeline's seqs are those Postgres would have counted, and a write that fails at the COMMIT takes
the whole unit of work with it."""

from __future__ import annotations

import uuid
from datetime import datetime

import asyncpg
import pytest

from .allocator_db import allocator_offering, pool, provisioning, requested, uow  # noqa: F401 (fixture)


async def _timeline(pool: asyncpg.Pool, alloc: uuid.UUID) -> list[tuple[int, str, str | None]]:  # noqa: F811
    rows = await pool.fetch(
        "SELECT seq, state, previous_state FROM allocation_timeline WHERE allocation_id = $1 ORDER BY seq", alloc
    )
    return [(r["seq"], r["state"], r["previous_state"]) for r in rows]


async def test_reads_in_the_unit_of_work_see_the_writes_behind_them(pool) -> None:  # noqa: F811
    alloc = await provisioning(pool, await allocator_offering(pool))
    before = await _timeline(pool, alloc)
    async with uow(pool) as work:
        row = await work.repos.lock(alloc)
        first = await work.repos.change_state(alloc, "active", row["state"], fields={"awaiting_result": False})
        await work.repos.update(alloc, enrolled=True)
        again = await work.repos.lock(alloc)  # sends what is behind first
        assert (again["state"], again["awaiting_result"], again["enrolled"]) == ("active", False, True)
        second = await work.repos.change_state(alloc, "releasing", "active", fields={})
        assert await work.repos.accepted_seq(alloc) == 2  # a read of the timeline sends it first too
        await work.commit()
    assert (first, second) == (before[-1][0] + 1, before[-1][0] + 2)
    assert await _timeline(pool, alloc) == [*before, (first, "active", "provisioning"), (second, "releasing", "active")]
    assert await pool.fetchval("SELECT state FROM allocations WHERE allocation_id = $1", alloc) == "releasing"


async def test_seqs_follow_the_committed_timeline_when_nothing_was_locked(pool) -> None:  # noqa: F811
    """Without the lock's count the repository lets Postgres count (one statement, not behind)."""
    alloc = await requested(pool, await allocator_offering(pool))
    before = await _timeline(pool, alloc)
    async with uow(pool) as work:
        seq = await work.repos.append_timeline(alloc, "accepted", "accepted", reason_code="note")
        await work.commit()
    assert seq == before[-1][0] + 1
    assert (await _timeline(pool, alloc))[-1] == (seq, "accepted", "accepted")


async def test_a_value_without_a_literal_is_sent_at_once_with_parameters(pool) -> None:  # noqa: F811
    alloc = await provisioning(pool, await allocator_offering(pool))
    naive = datetime(2026, 1, 2, 3, 4, 5)  # no time zone: never rendered as text, asyncpg encodes it
    async with uow(pool) as work:
        await work.repos.lock(alloc)
        await work.repos.update(alloc, task_deadline_at=naive, enrolled=True)
        assert work.repos.deferred_sql() == []  # nothing waits: it went with its parameters
        await work.commit()
    stored = await pool.fetchrow("SELECT task_deadline_at, enrolled FROM allocations WHERE allocation_id = $1", alloc)
    assert stored["enrolled"] is True
    assert stored["task_deadline_at"].replace(tzinfo=None) == naive


async def test_a_write_behind_that_fails_at_commit_leaves_nothing(pool) -> None:  # noqa: F811
    alloc = await provisioning(pool, await allocator_offering(pool))
    before = await _timeline(pool, alloc)
    with pytest.raises(asyncpg.UniqueViolationError):
        async with uow(pool) as work:
            row = await work.repos.lock(alloc)
            await work.repos.change_state(alloc, "active", row["state"], fields={"awaiting_result": False})
            # The same allocation id again: the INSERT behind fails at the COMMIT, with everything before it.
            await work.repos.insert(**{k: v for k, v in row.items() if k not in ("created_at", "updated_at")})
            await work.commit()
    assert await _timeline(pool, alloc) == before
    assert await pool.fetchval("SELECT state FROM allocations WHERE allocation_id = $1", alloc) == "provisioning"


async def test_a_seq_counted_by_postgres_keeps_the_next_one_behind_in_step(pool) -> None:  # noqa: F811
    """A change that had to go at once (a value without a literal) is counted by Postgres; the next change,
    written behind, must follow that count, not the one the lock read."""
    alloc = await provisioning(pool, await allocator_offering(pool))
    before = await _timeline(pool, alloc)
    async with uow(pool) as work:
        row = await work.repos.lock(alloc)
        naive = datetime(2026, 1, 2, 3, 4, 5)
        first = await work.repos.change_state(alloc, "active", row["state"], fields={"task_deadline_at": naive})
        second = await work.repos.change_state(alloc, "releasing", "active", fields={})
        await work.commit()
    assert (first, second) == (before[-1][0] + 1, before[-1][0] + 2)
    assert [s for _, s, _ in (await _timeline(pool, alloc))[-2:]] == ["active", "releasing"]


async def test_the_lock_says_whether_an_early_result_is_kept(pool) -> None:  # noqa: F811
    """Only a holder of the allocation's lock keeps an early result, so the lock's answer holds for the unit of
    work: with none kept, taking one sends no statement; with one kept, it is taken once."""
    alloc = await requested(pool, await allocator_offering(pool))
    task = f"prov-{alloc}"
    async with uow(pool) as work:
        await work.repos.lock(alloc)
        sent: list[str] = []
        work.conn.add_query_logger(lambda record: sent.append(record.query))
        assert await work.repos.take_early_result(alloc, task) is None
        assert sent == []
    await pool.execute(
        "INSERT INTO early_task_results (allocation_id, task_id, node_id, result, event_id) "
        "VALUES ($1, $2, 'n1', '{}', 'e1')",
        alloc,
        task,
    )
    async with uow(pool) as work:
        await work.repos.lock(alloc)
        assert await work.repos.take_early_result(alloc, task) == {"node_id": "n1", "result": {}}
        assert await work.repos.take_early_result(alloc, task) is None
        await work.commit()
    async with uow(pool) as work:
        await work.repos.lock(alloc)  # none kept now
        assert await work.repos.keep_early_result(alloc, task, "n2", {"status": "x"}, "e2")
        assert await work.repos.take_early_result(alloc, task) == {"node_id": "n2", "result": {"status": "x"}}
    assert await pool.fetchval("SELECT count(*) FROM early_task_results WHERE allocation_id = $1", alloc) == 0
