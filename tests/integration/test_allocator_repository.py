"""The allocator's repository on real Postgres: `save` holds what the aggregate recorded for the unit of work's
COMMIT (one round trip with the outbox rows, its values as `db.value_literal`s), and any other statement of the
repository sends what it holds first. A read through the repository in the same unit of work sees it, another
transaction does not until the COMMIT, the timeline's seqs are the aggregate's count, every value arrives as it
was (quotes, a comment, a minus), and a write that fails takes the whole unit of work with it: at its own
statement when it has parameters, at the COMMIT when it was held."""

from __future__ import annotations

import uuid
from datetime import datetime

import asyncpg
import pytest

from .allocator_db import allocator_offering, pool, provisioning, requested, uow  # noqa: F401 (fixture)

# A text that a statement rendered with its values inline would have to escape: quotes, a comment, a minus.
HOSTILE = "it's -1 -- $1; DROP TABLE allocations"


async def _timeline(conn: asyncpg.Pool | asyncpg.Connection, alloc: uuid.UUID) -> list[tuple[int, str, str | None]]:
    rows = await conn.fetch(
        "SELECT seq, state, previous_state FROM allocation_timeline WHERE allocation_id = $1 ORDER BY seq", alloc
    )
    return [(r["seq"], r["state"], r["previous_state"]) for r in rows]


async def test_a_save_is_held_for_the_commit_and_a_read_in_its_unit_of_work_sees_it(pool) -> None:  # noqa: F811
    allocator = await allocator_offering(pool)
    alloc_id = await provisioning(pool, allocator)
    before = await _timeline(pool, alloc_id)
    n = before[-1][0]
    async with uow(pool) as work:
        alloc = await work.repos.get(alloc_id, allocator.policy)
        assert alloc is not None and alloc.last_seq == n
        alloc.note("checked", {"by": HOSTILE, "n": -1}, answered=True)
        alloc.fail("test_failure", HOSTILE, None, cleanup_required=False)
        sent: list[str] = []
        work.conn.add_query_logger(lambda record: sent.append(record.query))
        await work.repos.save(alloc)
        assert (alloc.changes, alloc.timeline) == ({}, [])
        # Held: nothing sent yet, nothing another transaction could see.
        assert await pool.fetchval("SELECT state FROM allocations WHERE allocation_id = $1", alloc_id) == "provisioning"
        # A read through the repository sends the held writes first, so it sees them.
        again = await work.repos.get(alloc_id, allocator.policy)
        assert again is not None and (again.state, again.last_seq) == ("failed", n + 2)
        assert (await _timeline(work.conn, alloc_id))[-2:] == [
            (n + 1, "provisioning", "provisioning"),
            (n + 2, "failed", "provisioning"),
        ]
        await work.commit()
    # asyncpg calls a logger once its loop turns: the held writes went as one simple query, before the lock.
    assert sent[0].startswith("UPDATE allocations SET") and "INSERT INTO allocation_timeline" in sent[0], sent
    stored = await pool.fetchrow(
        "SELECT state, failure_reason, awaiting_result FROM allocations WHERE allocation_id = $1", alloc_id
    )
    assert tuple(stored) == ("failed", HOSTILE, False)
    assert await _timeline(pool, alloc_id) == [
        *before,
        (n + 1, "provisioning", "provisioning"),
        (n + 2, "failed", "provisioning"),
    ]
    detail = await pool.fetchrow(
        "SELECT detail ->> 'by' AS by, (detail ->> 'n')::int AS n FROM allocation_timeline "
        "WHERE allocation_id = $1 AND seq = $2",
        alloc_id,
        n + 1,
    )
    assert tuple(detail) == (HOSTILE, -1)


async def test_a_save_rides_on_the_commit_round_trip(pool) -> None:  # noqa: F811
    """The row's change and every timeline row it recorded go with the COMMIT and the outbox rows, in one round
    trip; a new allocation's row and its first rows too (the timeline's reference to the row holds)."""
    allocator = await allocator_offering(pool)
    alloc_id = await provisioning(pool, allocator)
    n = (await _timeline(pool, alloc_id))[-1][0]
    async with uow(pool) as work:
        alloc = await work.repos.get(alloc_id, allocator.policy)
        assert alloc is not None
        alloc.note("checked", {"by": HOSTILE}, answered=True)
        alloc.fail("test_failure", HOSTILE, None, cleanup_required=False)
        sent: list[str] = []
        work.conn.add_query_logger(lambda record: sent.append(record.query))
        await work.repos.save(alloc)
        await work.commit()
    assert len(sent) == 1 and sent[0].endswith("COMMIT"), sent
    assert "UPDATE allocations SET" in sent[0] and "INSERT INTO allocation_timeline" in sent[0]
    stored = await pool.fetchrow("SELECT state, failure_reason FROM allocations WHERE allocation_id = $1", alloc_id)
    assert tuple(stored) == ("failed", HOSTILE)
    assert (await _timeline(pool, alloc_id))[-2:] == [
        (n + 1, "provisioning", "provisioning"),
        (n + 2, "failed", "provisioning"),
    ]
    # A request's first save: the row and its first timeline rows.
    fresh = await requested(pool, allocator)
    assert [seq for seq, _, _ in await _timeline(pool, fresh)][:1] == [1]


async def test_a_held_write_that_fails_fails_the_commit_and_leaves_nothing(pool) -> None:  # noqa: F811
    allocator = await allocator_offering(pool)
    alloc_id = await provisioning(pool, allocator)
    before = await _timeline(pool, alloc_id)
    with pytest.raises(asyncpg.NotNullViolationError):
        async with uow(pool) as work:
            alloc = await work.repos.get(alloc_id, allocator.policy)
            assert alloc is not None
            alloc.note("before the failure", {}, answered=True)
            await work.repos.save(alloc)
            await work.repos.write(alloc_id, False, {"tenant_id": None}, [])  # NOT NULL: refused at the COMMIT
            await work.commit()
    assert await _timeline(pool, alloc_id) == before
    stored = await pool.fetchrow("SELECT state, tenant_id FROM allocations WHERE allocation_id = $1", alloc_id)
    assert stored["state"] == "provisioning" and stored["tenant_id"] is not None


async def test_two_saves_in_one_unit_of_work_keep_counting_the_timeline(pool) -> None:  # noqa: F811
    allocator = await allocator_offering(pool)
    alloc_id = await provisioning(pool, allocator)
    n = (await _timeline(pool, alloc_id))[-1][0]
    async with uow(pool) as work:
        alloc = await work.repos.get(alloc_id, allocator.policy)
        assert alloc is not None
        alloc.note("first", {})
        await work.repos.save(alloc)
        alloc.note("second", {})
        await work.repos.save(alloc)
        again = await work.repos.get(alloc_id, allocator.policy)  # the lock reads what this unit of work wrote
        assert again is not None and again.last_seq == n + 2
        await work.commit()
    assert [seq for seq, _, _ in await _timeline(pool, alloc_id)][-2:] == [n + 1, n + 2]


async def test_seqs_follow_the_committed_timeline_when_nothing_was_locked(pool) -> None:  # noqa: F811
    """Without the lock's count the repository lets Postgres count."""
    alloc = await requested(pool, await allocator_offering(pool))
    before = await _timeline(pool, alloc)
    async with uow(pool) as work:
        seq = await work.repos.append_timeline(alloc, "accepted", "accepted", reason_code="note")
        await work.commit()
    assert seq == before[-1][0] + 1
    assert (await _timeline(pool, alloc))[-1] == (seq, "accepted", "accepted")


async def test_a_naive_datetime_is_bound_as_asyncpg_encodes_it(pool) -> None:  # noqa: F811
    alloc = await provisioning(pool, await allocator_offering(pool))
    naive = datetime(2026, 1, 2, 3, 4, 5)
    async with uow(pool) as work:
        await work.repos.lock(alloc)
        await work.repos.update(alloc, task_deadline_at=naive, enrolled=True)
        await work.commit()
    stored = await pool.fetchrow("SELECT task_deadline_at, enrolled FROM allocations WHERE allocation_id = $1", alloc)
    assert stored["enrolled"] is True
    assert stored["task_deadline_at"].replace(tzinfo=None) == naive


async def test_a_write_that_fails_raises_at_its_statement_and_leaves_nothing(pool) -> None:  # noqa: F811
    allocator = await allocator_offering(pool)
    alloc_id = await provisioning(pool, allocator)
    before = await _timeline(pool, alloc_id)
    async with uow(pool) as work:
        row = await work.repos.lock(alloc_id)
        alloc = work.repos.aggregate(row, allocator.policy)
        alloc.note("before the failure", {}, answered=True)
        await work.repos.save(alloc)
        # The same allocation id again: refused by this statement, not later at the COMMIT.
        with pytest.raises(asyncpg.UniqueViolationError):
            await work.repos.insert(**{k: v for k, v in row.items() if k not in ("created_at", "updated_at")})
    assert await _timeline(pool, alloc_id) == before
    stored = await pool.fetchrow("SELECT state, awaiting_result FROM allocations WHERE allocation_id = $1", alloc_id)
    assert tuple(stored) == ("provisioning", True)


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
