"""One unit of work: a transaction that owns the repositories, the inbox row and the outbox.

Every bus handler, admin mutation and background worker does its domain work through one of these, so
the rule "domain rows, inbox row and outbox rows commit together or not at all" lives in one place:

    async with uow_factory(correlation_id=…, causation_id=…) as uow:
        if await uow.seen(consumer, message_id):
            return                      # a redelivery: its effects are already committed
        row = await uow.repos.allocations.lock(…)
        uow.events.add("allocation.accepted", payload, aggregate_id=…)
        await uow.commit()              # leaving without commit rolls everything back

Events are collected as they are raised and written to the outbox with the COMMIT, in one round trip,
with one NOTIFY that carries them to the relay. `FakeUnitOfWork` has the same surface in memory, so
handlers are unit-tested without servers (the style of cosmicpython's `service_layer/unit_of_work.py`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, Protocol, TypeVar

import asyncpg

from . import inbox
from .contract import Envelope
from .db import text_literal
from .outbox import EventCollector, pending_statement

R = TypeVar("R")


class WritesAtCommit(Protocol):
    """Repositories that hold writes for the COMMIT: statements without parameters (`db.value_literal`), sent
    in the commit's round trip, before the outbox rows. Such a repository sends what it holds before any other
    statement of its own, so its reads and writes keep their order; a held write that fails does so at COMMIT,
    which fails the unit of work like any other statement would."""

    def take_writes(self) -> list[str]: ...


class UnitOfWork(Generic[R]):
    """A Postgres transaction in one service's schema; `repos` is built on its connection.

    Its own BEGIN and COMMIT are sent as simple queries that carry the inbox claim and the outbox rows
    (`expect_inbox`, `pending_statement`): asyncpg sends each statement as a round trip of its own, and
    on a 2-core host the round trips -- a loopback send and a context switch each -- were the largest
    cost of handling a message. Savepoints inside it are plain SQL (`SAVEPOINT …`); asyncpg's
    `Connection.transaction()` refuses to nest in a transaction it did not start."""

    def __init__(
        self,
        pool: asyncpg.Pool,
        schema: str,
        service: str,
        repositories: Callable[[asyncpg.Connection], R],
        *,
        correlation_id: str | None = None,
        causation_id: str | None = None,
    ) -> None:
        self.pool = pool
        self.schema = schema
        self.events = EventCollector(service, correlation_id, causation_id)
        self._repositories = repositories
        self._conn: asyncpg.Connection | None = None
        self._inbox_key: tuple[str, str] | None = None
        self._inbox_host: inbox.HostInbox | None = None
        self._inbox_fresh: bool | None = None
        self._first_lock: str | None = None
        self.committed = False

    @property
    def conn(self) -> asyncpg.Connection:
        if self._conn is None:
            raise RuntimeError("the unit of work is not open (use `async with`)")
        return self._conn

    def expect_inbox(self, consumer: str, message_id: str, host: inbox.HostInbox | None = None) -> None:
        """Claim this inbox row with the BEGIN (before `async with`); `seen` then answers without a query.
        `host`: a host-fed consumer's message, its row kept among its node's newest (`inbox.HostInbox`)."""
        self._inbox_key = (consumer, message_id)
        self._inbox_host = host

    def lock_first(self, key: str) -> None:
        """Take the transaction-scoped advisory lock `hashtext(key)` with the BEGIN, before the inbox claim
        (before `async with`): the aggregate lock a handler would otherwise take as its first statement."""
        self._first_lock = key

    def holds_lock(self, key: str) -> bool:
        """Whether `lock_first(key)` was taken with the BEGIN: the handler need not ask again."""
        return self._conn is not None and self._first_lock == key

    async def __aenter__(self) -> "UnitOfWork[R]":
        self._conn = await self.pool.acquire()
        try:
            await self._begin()
        except (asyncpg.ConnectionDoesNotExistError, asyncpg.InterfaceError, OSError):
            # The pooled connection died while idle (Postgres restarted, a failover): the pool does not check
            # before handing it out. Nothing happened on it yet, so every pooled connection is retired and
            # the transaction starts once more on a fresh one; a second failure is the caller's.
            await self.pool.release(self._conn)
            self._conn = None
            await self.pool.expire_connections()
            self._conn = await self.pool.acquire()
            try:
                await self._begin()
            except BaseException:
                await self._abandon()
                raise
        except BaseException:
            await self._abandon()
            raise
        self.repos = self._repositories(self._conn)
        return self

    async def _begin(self) -> None:
        statements = ["BEGIN"]
        if self._first_lock is not None:
            statements.append(f"SELECT pg_advisory_xact_lock(hashtext({text_literal(self._first_lock)}))")
        if self._inbox_key is not None:
            statements.append(inbox.claim_statement(*self._inbox_key, self._inbox_host))
        status = await self.conn.execute("; ".join(statements))
        if self._inbox_key is not None:
            self._inbox_fresh = inbox.claimed(status)

    async def _abandon(self) -> None:
        """Roll back whatever is still open (nothing after a commit) and give the connection back."""
        conn, self._conn = self._conn, None
        if conn is None:
            return
        try:
            if not conn.is_closed() and conn.is_in_transaction():
                await conn.execute("ROLLBACK")
        finally:
            await self.pool.release(conn)

    async def __aexit__(self, *exc: object) -> None:
        await self._abandon()

    async def seen(self, consumer: str, message_id: str) -> bool:
        """Claim the inbox row; True when this consumer already processed the message."""
        if self._inbox_fresh is not None and self._inbox_key == (consumer, message_id):
            fresh, self._inbox_fresh = self._inbox_fresh, None  # asked again, the row is ours: seen
            return not fresh
        return not await inbox.claim(self.conn, consumer, message_id)

    async def commit(self) -> None:
        # getattr, not isinstance: a runtime protocol check costs microseconds on every commit of every service.
        take_writes = getattr(self.repos, "take_writes", None)
        statements: list[str] = take_writes() if take_writes is not None else []
        rows = pending_statement(self.schema, self.events.pending)
        if rows:
            statements.append(rows)
        statements.append("COMMIT")
        status = await self.conn.execute("; ".join(statements))
        if status != "COMMIT":
            # Postgres answers COMMIT of a transaction an error had already aborted with ROLLBACK, not an error.
            raise asyncpg.InFailedSQLTransactionError(f"the transaction was rolled back at commit ({status})")
        self.committed = True


class FakeUnitOfWork(Generic[R]):
    """In memory, for handler unit tests: what was committed, which events, which inbox rows."""

    def __init__(self, repos: R, service: str = "test", *, seen: set[tuple[str, str]] | None = None) -> None:
        self.repos = repos
        self.events = EventCollector(service)
        self.inbox: set[tuple[str, str]] = seen if seen is not None else set()
        self._claimed: set[tuple[str, str]] = set()
        self._locks: set[str] = set()
        self.committed = False
        self.published: list[Envelope] = []

    @property
    def conn(self) -> Any:
        raise RuntimeError("a fake unit of work has no connection: go through the repositories")

    def expect_inbox(self, consumer: str, message_id: str, host: inbox.HostInbox | None = None) -> None:
        """Nothing to fold: `seen` answers from memory (and keeps every row: the cap is Postgres's)."""

    def lock_first(self, key: str) -> None:
        self._locks.add(key)

    def holds_lock(self, key: str) -> bool:
        return key in self._locks

    async def __aenter__(self) -> "FakeUnitOfWork[R]":
        return self

    async def __aexit__(self, *exc: object) -> None:
        if not self.committed:  # a rollback: neither the events nor the inbox row happened
            self.events.pending.clear()
            self._claimed.clear()

    async def seen(self, consumer: str, message_id: str) -> bool:
        key = (consumer, message_id)
        if key in self.inbox or key in self._claimed:
            return True
        self._claimed.add(key)
        return False

    async def commit(self) -> None:
        self.published.extend(p.envelope for p in self.events.pending)
        self.inbox |= self._claimed
        self.committed = True


def no_repositories(conn: asyncpg.Connection) -> None:
    return None
