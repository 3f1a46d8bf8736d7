"""The JetStream traffic of one connection, counted, so that a credential switch can wait until none is in flight.

A connection changes credentials only by reconnecting (NATS has no re-authentication on a live session), and a
reconnect drops whatever the server was sending at that instant: a message pulled for us, a PubAck. Everything
that asks JetStream for an answer on our connection — a publish awaiting its PubAck (`Bus.publish`, the outbox
relay), a pull request until it is filled or expired (`pull.PullLoop`) — therefore passes through the gate. A
switch (`creds_renewal`) closes it: new passages wait, the ones in flight finish (a pull request within its
expiry), and the reconnect happens with nothing owed to us. Acks and progress acks are plain publishes that
need no answer: nats-py buffers them while it reconnects and sends them on the new session.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager


class TrafficGate:
    def __init__(self) -> None:
        self._open = asyncio.Event()
        self._open.set()
        self._idle = asyncio.Event()
        self._idle.set()
        self.in_flight = 0

    @property
    def is_open(self) -> bool:
        return self._open.is_set()

    async def wait_open(self) -> None:
        await self._open.wait()

    def enter(self) -> None:
        """Count a passage that the caller has checked the gate for (`wait_open`) without yielding since."""
        self.in_flight += 1
        self._idle.clear()

    def leave(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0:
            self._idle.set()

    @asynccontextmanager
    async def passage(self) -> AsyncIterator[None]:
        """One exchange that expects an answer from the server; waits while the gate is closed."""
        while not self._open.is_set():
            await self._open.wait()
        self.enter()
        try:
            yield
        finally:
            self.leave()

    @asynccontextmanager
    async def closed(self) -> AsyncIterator[None]:
        """Close the gate, wait for every passage in flight to end, and reopen it on leaving."""
        self._open.clear()
        try:
            await self._idle.wait()
            yield
        finally:
            self._open.set()
