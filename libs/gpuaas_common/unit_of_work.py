"""One unit of work: a transaction that owns the repositories, the inbox row and the outbox.

Every bus handler, admin mutation and background worker does its domain work through one of these, so
the rule "domain rows, inbox row and outbox rows commit together or not at all" lives in one place:

    async with uow_factory(correlation_id=…, causation_id=…) as uow:
        if await uow.seen(consumer, message_id):
            return                      # a redelivery: its effects are already committed
        row = await uow.repos.allocations.lock(…)
        uow.events.add("allocation.accepted", payload, aggregate_id=…)
        await uow.commit()              # leaving without commit rolls everything back

Events are collected as they are raised and written to the outbox at commit, in one statement, with
one NOTIFY to wake the relay. `FakeUnitOfWork` has the same surface in memory, so handlers are unit-
tested without servers (the style of cosmicpython's `service_layer/unit_of_work.py`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, TypeVar

import asyncpg

from . import inbox
from .contract import Envelope
from .outbox import EventCollector, write_pending

R = TypeVar("R")


class UnitOfWork(Generic[R]):
    """A Postgres transaction in one service's schema; `repos` is built on its connection."""

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
        self._tx: Any = None
        self.committed = False

    @property
    def conn(self) -> asyncpg.Connection:
        if self._conn is None:
            raise RuntimeError("the unit of work is not open (use `async with`)")
        return self._conn

    async def __aenter__(self) -> "UnitOfWork[R]":
        self._conn = await self.pool.acquire()
        self._tx = self._conn.transaction()
        try:
            await self._tx.start()
        except (asyncpg.ConnectionDoesNotExistError, asyncpg.InterfaceError, OSError):
            # The pooled connection died while idle (Postgres restarted, a failover): the pool does not check
            # before handing it out. Nothing happened on it yet, so every pooled connection is retired and
            # the transaction starts once more on a fresh one; a second failure is the caller's.
            await self.pool.release(self._conn)
            self._conn = None
            await self.pool.expire_connections()
            self._conn = await self.pool.acquire()
            self._tx = self._conn.transaction()
            try:
                await self._tx.start()
            except BaseException:
                await self.pool.release(self._conn)
                self._conn = None
                raise
        self.repos = self._repositories(self._conn)
        return self

    async def __aexit__(self, *exc: object) -> None:
        try:
            if not self.committed:
                await self._tx.rollback()
        finally:
            conn, self._conn = self._conn, None
            await self.pool.release(conn)

    async def seen(self, consumer: str, message_id: str) -> bool:
        """Claim the inbox row; True when this consumer already processed the message."""
        return not await inbox.claim(self.conn, consumer, message_id)

    async def commit(self) -> None:
        await write_pending(self.conn, self.schema, self.events.pending)
        await self._tx.commit()
        self.committed = True


class FakeUnitOfWork(Generic[R]):
    """In memory, for handler unit tests: what was committed, which events, which inbox rows."""

    def __init__(self, repos: R, service: str = "test", *, seen: set[tuple[str, str]] | None = None) -> None:
        self.repos = repos
        self.events = EventCollector(service)
        self.inbox: set[tuple[str, str]] = seen if seen is not None else set()
        self._claimed: set[tuple[str, str]] = set()
        self.committed = False
        self.published: list[Envelope] = []

    @property
    def conn(self) -> Any:
        raise RuntimeError("a fake unit of work has no connection: go through the repositories")

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
