"""The unit of work commits domain rows, the inbox row and the raised events together, or nothing."""

from __future__ import annotations

import uuid

import asyncpg
import pytest

from gpuaas_common.bus import HandlerContext, deliver
from gpuaas_common.contract import Envelope
from gpuaas_common.contract import messages as m
from gpuaas_common.migrations import apply_migrations
from gpuaas_common.unit_of_work import FakeUnitOfWork, UnitOfWork, no_repositories

SCHEMA = "uow_test"


@pytest.fixture
async def pool(fresh_db):
    conn = await asyncpg.connect(fresh_db)
    await apply_migrations(conn, SCHEMA, None)
    await conn.execute(f"CREATE TABLE {SCHEMA}.effects (id text PRIMARY KEY)")
    await conn.close()
    p = await asyncpg.create_pool(fresh_db, min_size=1, max_size=2, server_settings={"search_path": SCHEMA})
    yield p
    await p.close()


def _message() -> HandlerContext:
    payload = m.AllocationReleaseRequested(allocation_id=uuid.uuid4(), reason="test")
    env = Envelope.wrap(
        "allocation.release_requested", payload.model_dump(mode="json"), producer="t", correlation_id="c"
    )
    return HandlerContext(env, payload, "gpuaas.allocation.release_requested", "consumer-a", 1)


async def _effect_and_event(ctx: HandlerContext) -> None:
    await ctx.conn.execute("INSERT INTO effects VALUES ($1)", str(ctx.payload.allocation_id))
    await ctx.outbox.add("allocation.release_requested", ctx.payload, aggregate_id=str(ctx.payload.allocation_id))


async def _counts(pool) -> tuple[int, int, int]:
    return (
        await pool.fetchval("SELECT count(*) FROM effects"),
        await pool.fetchval("SELECT count(*) FROM inbox"),
        await pool.fetchval("SELECT count(*) FROM outbox"),
    )


async def test_effects_inbox_and_events_commit_together_once(pool) -> None:
    ctx = _message()
    assert await deliver(_effect_and_event, ctx, UnitOfWork(pool, SCHEMA, "svc", no_repositories))
    assert await _counts(pool) == (1, 1, 1)
    body = await pool.fetchval("SELECT body FROM outbox")
    assert Envelope.model_validate_json(body).causation_id is None  # no causing message was given
    # The same message again is a no-op in effect.
    assert not await deliver(_effect_and_event, _again(ctx), UnitOfWork(pool, SCHEMA, "svc", no_repositories))
    assert await _counts(pool) == (1, 1, 1)


def _again(ctx: HandlerContext) -> HandlerContext:
    return HandlerContext(ctx.envelope, ctx.payload, ctx.subject, ctx.consumer, 2)


async def test_a_failing_handler_leaves_nothing_behind(pool) -> None:
    async def fails_after_effects(ctx: HandlerContext) -> None:
        await _effect_and_event(ctx)
        raise RuntimeError("boom")

    ctx = _message()
    with pytest.raises(RuntimeError):
        await deliver(fails_after_effects, ctx, UnitOfWork(pool, SCHEMA, "svc", no_repositories))
    assert await _counts(pool) == (0, 0, 0)
    # And the retry is not mistaken for a duplicate.
    assert await deliver(_effect_and_event, _again(ctx), UnitOfWork(pool, SCHEMA, "svc", no_repositories))
    assert await _counts(pool) == (1, 1, 1)


async def test_the_fake_forgets_a_rolled_back_message_like_the_real_one() -> None:
    async def fails(ctx: HandlerContext) -> None:
        await ctx.outbox.add("allocation.release_requested", ctx.payload, aggregate_id="a")
        raise RuntimeError("boom")

    uow = FakeUnitOfWork(repos=None)
    ctx = _message()
    with pytest.raises(RuntimeError):
        await deliver(fails, ctx, uow)
    assert (uow.published, uow.inbox) == ([], set())

    async def ok(ctx: HandlerContext) -> None:
        await ctx.outbox.add("allocation.release_requested", ctx.payload, aggregate_id="a")

    assert await deliver(ok, _again(ctx), uow)
    assert [e.type for e in uow.published] == ["allocation.release_requested"]
    assert not await deliver(ok, _again(ctx), FakeUnitOfWork(repos=None, seen=uow.inbox))


# Values the inbox claim and the outbox rows carry into SQL text (they travel as literals with BEGIN and COMMIT).
HOSTILE = ["it's", "back\\slash", "\\'); DROP TABLE effects; --", "$$ $tag$", "ünï€ødé 🚀", "E'", "\\x41", "''"]


@pytest.mark.parametrize("text", HOSTILE)
async def test_hostile_ids_and_bodies_arrive_as_written(pool, text) -> None:
    ctx = _message()
    ctx = HandlerContext(ctx.envelope.model_copy(update={"event_id": text}), ctx.payload, ctx.subject, text, 1)

    async def hostile_event(ctx: HandlerContext) -> None:
        payload = m.AllocationReleaseRequested(allocation_id=ctx.payload.allocation_id, reason=text)
        await ctx.outbox.add("allocation.release_requested", payload, aggregate_id=text, event_id=text + "/e")

    assert await deliver(hostile_event, ctx, UnitOfWork(pool, SCHEMA, "svc", no_repositories))
    assert await pool.fetchrow("SELECT consumer, message_id FROM inbox") == (text, text)
    row = await pool.fetchrow("SELECT event_id, aggregate_id, body FROM outbox")
    assert (row["event_id"], row["aggregate_id"]) == (text + "/e", text)
    assert Envelope.model_validate_json(row["body"]).payload["reason"] == text
    assert await pool.fetchval("SELECT count(*) FROM effects") == 0  # the table is still there
    assert not await deliver(hostile_event, _again(ctx), UnitOfWork(pool, SCHEMA, "svc", no_repositories))


async def test_events_keep_the_order_they_were_raised(pool) -> None:
    async def three(ctx: HandlerContext) -> None:
        for reason in ("first", "second", "third"):
            payload = m.AllocationReleaseRequested(allocation_id=ctx.payload.allocation_id, reason=reason)
            await ctx.outbox.add("allocation.release_requested", payload, aggregate_id="a")

    assert await deliver(three, _message(), UnitOfWork(pool, SCHEMA, "svc", no_repositories))
    bodies = await pool.fetch("SELECT body FROM outbox ORDER BY id")
    assert [Envelope.model_validate_json(b).payload["reason"] for (b,) in bodies] == ["first", "second", "third"]


async def test_a_swallowed_database_error_fails_the_commit_instead_of_dropping_the_work(pool) -> None:
    """Postgres answers COMMIT of an aborted transaction with ROLLBACK, not an error: the commit must not
    report success (and the inbox row must not make the retry look like a duplicate)."""

    async def swallows(ctx: HandlerContext) -> None:
        try:
            await ctx.conn.execute("INSERT INTO no_such_table VALUES (1)")
        except asyncpg.UndefinedTableError:
            pass

    ctx = _message()
    with pytest.raises(asyncpg.InFailedSQLTransactionError):
        await deliver(swallows, ctx, UnitOfWork(pool, SCHEMA, "svc", no_repositories))
    assert await _counts(pool) == (0, 0, 0)
    assert await deliver(_effect_and_event, _again(ctx), UnitOfWork(pool, SCHEMA, "svc", no_repositories))
    assert await _counts(pool) == (1, 1, 1)


async def test_the_first_lock_is_held_from_the_begin_until_the_commit(pool) -> None:
    """The aggregate lock a handler names up front (`deliver(..., first_lock=)`) travels with the BEGIN: it
    is held when the handler starts, and the same key taken the ordinary way elsewhere waits for it."""
    key = "gpuaas-allocation:it's-mine"

    async def probe(ctx: HandlerContext) -> None:
        assert ctx.uow.holds_lock(key) and not ctx.uow.holds_lock("another")
        async with pool.acquire() as other:
            assert not await other.fetchval("SELECT pg_try_advisory_lock(hashtext($1))", key)
        await _effect_and_event(ctx)

    assert await deliver(probe, _message(), UnitOfWork(pool, SCHEMA, "svc", no_repositories), first_lock=key)
    assert await _counts(pool) == (1, 1, 1)
    async with pool.acquire() as other:
        assert await other.fetchval("SELECT pg_try_advisory_lock(hashtext($1))", key)
        await other.execute("SELECT pg_advisory_unlock_all()")
