"""The unit of work commits domain rows, the inbox row and the raised events together, or nothing."""

from __future__ import annotations

import asyncio
import uuid

import asyncpg
import pytest

from gpuaas_common.bus import HandlerContext, deliver
from gpuaas_common.contract import Envelope
from gpuaas_common.contract import messages as m
from gpuaas_common.inbox import HostInbox
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
    # A host's node id comes from its subject: it travels as a literal too, and its group is trimmed by it.
    for message_id in (text + "/1", text + "/2"):
        uow = UnitOfWork(pool, SCHEMA, "svc", no_repositories)
        assert await deliver(_nothing, _message_to(text, message_id), uow, host=HostInbox(text, 1))
    assert await pool.fetch("SELECT message_id FROM inbox WHERE node_id = $1", text) == [(text + "/2",)]


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


async def _nothing(ctx: HandlerContext) -> None:
    return None


def _message_to(consumer: str, message_id: str) -> HandlerContext:
    ctx = _message()
    envelope = ctx.envelope.model_copy(update={"event_id": message_id})
    return HandlerContext(envelope, ctx.payload, ctx.subject, consumer, 1)


async def test_a_hosts_inbox_rows_are_capped_per_consumer_and_node_the_newest_kept(pool) -> None:
    """Issue 38: a host-fed consumer's inbox row names the node, and the claim that adds one keeps that (consumer,
    node)'s newest `keep` rows, so a host sending more leaves at most `keep` right after each message. A repeat of a
    kept message is still a repeat, the oldest kept included; one of a message trimmed away is handled again (the
    cap's price, `inbox`'s docstring). Another node, another consumer, rows naming no node: untouched."""
    keep = 3

    async def claim(consumer: str, message_id: str, host: HostInbox | None) -> bool:
        uow = UnitOfWork(pool, SCHEMA, "svc", no_repositories)
        return await deliver(_nothing, _message_to(consumer, message_id), uow, host=host)

    async def rows(consumer: str, node: str | None) -> list[str]:
        found = await pool.fetch(
            "SELECT message_id FROM inbox WHERE consumer = $1 AND node_id IS NOT DISTINCT FROM $2 ORDER BY received_at",
            consumer,
            node,
        )
        return [r["message_id"] for r in found]

    n1, n2 = HostInbox("n1", keep), HostInbox("n2", keep)
    others = [("c", "n2-0", n2), ("c", "n2-1", n2), ("other", "o-0", n1), ("other", "o-1", n1)]
    others += [("c", f"plain-{i}", None) for i in range(keep + 2)]
    for consumer, message_id, host in others:
        assert await claim(consumer, message_id, host)
    sent = [f"m{i}" for i in range(keep * 3)]
    for i, message_id in enumerate(sent):
        assert await claim("c", message_id, n1)
        assert await rows("c", "n1") == sent[max(0, i + 1 - keep) : i + 1]
    newest = sent[-keep:]
    assert not await claim("c", newest[0], n1)  # the oldest kept, with the group full: still a repeat
    assert await rows("c", "n1") == newest
    assert await claim("c", sent[0], n1)  # trimmed away: handled again, and it is the newest now
    assert await rows("c", "n1") == [*newest[1:], sent[0]]
    assert await rows("c", "n2") == ["n2-0", "n2-1"]
    assert await rows("other", "n1") == ["o-0", "o-1"]
    assert await rows("c", None) == [f"plain-{i}" for i in range(keep + 2)]


async def test_a_hosts_concurrent_claims_take_turns_and_the_cap_holds(fresh_db, pool) -> None:
    """Messages of one host at one consumer run at once in other lanes and replicas: each claim waits for the
    group's turn, so each row's place is unique and the group never holds more than the cap."""
    keep, many = 4, 24
    wide = await asyncpg.create_pool(fresh_db, min_size=1, max_size=8, server_settings={"search_path": SCHEMA})
    try:

        async def claim(i: int) -> bool:
            uow = UnitOfWork(wide, SCHEMA, "svc", no_repositories)
            return await deliver(_nothing, _message_to("c", f"m{i}"), uow, host=HostInbox("n1", keep))

        assert all(await asyncio.gather(*(claim(i) for i in range(many))))
    finally:
        await wide.close()
    places = [r["node_seq"] for r in await pool.fetch("SELECT node_seq FROM inbox ORDER BY node_seq")]
    assert places == list(range(many - keep + 1, many + 1))


async def test_the_fake_takes_a_hosts_inbox_like_the_real_one() -> None:
    uow = FakeUnitOfWork(repos=None)
    ctx = _message_to("c", "m")
    assert await deliver(_nothing, ctx, uow, host=HostInbox("n1", 1))
    assert not await deliver(_nothing, ctx, FakeUnitOfWork(repos=None, seen=uow.inbox), host=HostInbox("n1", 1))


def test_a_hosts_inbox_group_names_a_node_and_keeps_a_row() -> None:
    for node, keep in (("", 5), ("n1", 0)):
        with pytest.raises(ValueError, match="keeps at least one row"):
            HostInbox(node, keep)
