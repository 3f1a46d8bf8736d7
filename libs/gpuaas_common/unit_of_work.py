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
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import asyncpg
from pydantic import BaseModel

from . import inbox
from .contract import Envelope, spec_for
from .outbox import notify_channel

R = TypeVar("R")


@dataclass
class PendingEvent:
    envelope: Envelope
    aggregate_id: str
    subject: str


@dataclass
class EventCollector:
    """Events raised during a unit of work; each gets its envelope (and event id) at once."""

    producer: str
    correlation_id: str | None = None
    causation_id: str | None = None
    pending: list[PendingEvent] = field(default_factory=list)

    async def add(
        self,
        type_: str,
        payload: BaseModel,
        *,
        aggregate_id: str,
        correlation_id: str | None = None,
        event_id: str | None = None,
        **subject_params: str,
    ) -> Envelope:
        """Async for the call sites' sake (they once wrote the row here); nothing is written before commit."""
        spec = spec_for(type_)
        if not isinstance(payload, spec.model):
            raise TypeError(f"{type_} needs a {spec.model.__name__} payload, got {type(payload).__name__}")
        envelope = Envelope.wrap(
            type_,
            payload.model_dump(mode="json"),
            producer=self.producer,
            correlation_id=correlation_id or self.correlation_id or aggregate_id,
            causation_id=self.causation_id,
            event_id=event_id,
        )
        self.pending.append(PendingEvent(envelope, aggregate_id, spec.subject(**subject_params)))
        return envelope

    def of_type(self, type_: str) -> list[Envelope]:
        return [p.envelope for p in self.pending if p.envelope.type == type_]


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
        await self._tx.start()
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
        pending = self.events.pending
        if pending:
            await self.conn.executemany(
                "INSERT INTO outbox (event_id, aggregate_id, subject, body) VALUES ($1, $2, $3, $4) "
                "ON CONFLICT (event_id) DO NOTHING",
                [
                    (p.envelope.event_id, p.aggregate_id, p.subject, p.envelope.model_dump_json().encode())
                    for p in pending
                ],
            )
            # Delivered at commit; one per transaction is enough to wake the relay.
            await self.conn.execute("SELECT pg_notify($1, '')", notify_channel(self.schema))
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
