"""Following one stream into the read models, from the position the models last committed.

Not a durable: the position lives in the models' own database, committed in the transaction that wrote the
rows, so the models and their position never disagree. At every start (and after anything irregular: a gap in
the consumer's sequence, a lost connection, a failed commit) the consumer is made afresh from that position,
with no acks; an empty schema starts at the first message the stream retains, which is how the models rebuild.
Messages are applied in stream order, in batches of what has arrived, one transaction a batch. A batch is first
applied as a whole, with no savepoint per message: what its allocation and node task events need is read at
once, and the rows they make are written at its end, a statement each in stream order (BatchProjection). Under
load the follower's pace is its round trips to Postgres, one after another: a handful a batch, not ~7 a message.
Should any message of it fail, that transaction is rolled back and the batch applied again one message at a
time, each in a savepoint, so one that cannot be placed is dead-lettered with its reason and the rest of the
batch commits.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from typing import Any

import asyncpg
import nats.errors
import nats.js.errors
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from prometheus_client import Counter, Gauge, Histogram

from gpuaas_common.bus import Bus, PermanentError
from gpuaas_common.bus_budget import HostBudget
from gpuaas_common.bus_dispatch import dead_letter
from gpuaas_common.jetstream import ConsumerSpec
from gpuaas_common.logging import get_logger
from gpuaas_common.pull import PullLoop
from gpuaas_common.settings import ServiceSettings

from ..adapters.projection import BatchProjection, Projection
from ..service_layer.projection import Message, apply, apply_batch

log = get_logger(__name__)

LAG = Histogram(
    "gpuaas_ops_view_lag_seconds",
    "From a message's arrival in its stream to the commit of the read-model rows it made",
    ["stream"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 30.0, 300.0),
)
APPLIED = Counter("gpuaas_ops_view_messages_total", "Stream messages applied to the read models", ["stream", "outcome"])
POSITION = Gauge("gpuaas_ops_view_position", "Last stream sequence the read models committed", ["stream"])

# A consumer nobody pulls from goes away by itself this long after (a follower that died without deleting it).
INACTIVE_S = 30.0
# Between attempts after a failure, growing to the last.
BACKOFF_S = (0.2, 0.5, 1.0, 2.0, 5.0)
# Rows of a host-fed table kept per host (adapters/host_rows.py) unless the service says otherwise.
HOST_ROWS_PER_NODE: int = ServiceSettings.model_fields["host_rows_per_node"].default
# A handler bug or a value the models' columns cannot hold is that message's problem, not the stream's.
_UNPLACEABLE_DB = (asyncpg.DataError, asyncpg.IntegrityConstraintViolationError)


class _Irregular(Exception):
    """Start again from the committed position."""


class _Unplaced(Exception):
    """A message of a batch applied without savepoints failed: apply the batch again, each message alone."""


class StreamFollower:
    def __init__(
        self,
        nc: NatsClient,
        js: JetStreamContext,
        pool: asyncpg.Pool,
        spec: ConsumerSpec,
        *,
        name: str,
        dead_letters: Bus,
        batch: int,
        budget: HostBudget | None = None,
        host_rows_per_node: int = HOST_ROWS_PER_NODE,
    ) -> None:
        """`budget`: the stream carries hosts' messages; a node's over its budget advance the position and are
        applied to nothing (bus_budget). `host_rows_per_node`: the cap each batch's transaction holds the
        host-fed tables' groups it grew at (adapters/host_rows.py)."""
        self.nc, self.js, self.pool = nc, js, pool
        self.stream = spec.stream
        self.filter = spec.filter_subject
        # The DLQ subject is gpuaas.dlq.<name>: the one the identity may publish on.
        self.spec = ConsumerSpec(durable=name, stream=spec.stream, filter_subject=spec.filter_subject)
        self.dead_letters = dead_letters
        self.batch = batch
        self.budget = budget
        self.host_rows_per_node = host_rows_per_node
        self.position = 0
        self._consumer_seq = 0

    async def run(self) -> None:
        failures = 0
        while True:
            try:
                await self._follow()
            except asyncio.CancelledError:
                raise
            except (_Irregular, nats.errors.Error, asyncpg.PostgresError, OSError, TimeoutError) as exc:
                delay = BACKOFF_S[min(failures, len(BACKOFF_S) - 1)]
                failures += 1
                log.warning(
                    "follow_restarting", stream=self.stream, position=self.position, error=repr(exc), delay_s=delay
                )
                await asyncio.sleep(delay)  # back-off before the next attempt, not a wait for something

    async def _follow(self) -> None:
        async with self.pool.acquire() as conn:
            self.position = (await Projection(conn).positions()).get(self.stream, 0)
        await self._recreate_consumer()
        queue: asyncio.Queue[tuple[Msg, Any]] = asyncio.Queue()
        pull = PullLoop(self.nc, self.spec, lambda msg, done: queue.put_nowait((msg, done)), self.batch)
        puller = asyncio.create_task(pull.run(), name=f"pull-{self.spec.durable}")
        log.info("follow_started", stream=self.stream, position=self.position)
        try:
            while True:
                got = asyncio.create_task(queue.get())
                await asyncio.wait({got, puller}, return_when=asyncio.FIRST_COMPLETED)
                if not got.done():
                    got.cancel()
                    raise _Irregular(
                        f"pull loop ended: {puller.exception() if not puller.cancelled() else 'cancelled'}"
                    )
                batch = [got.result()]
                while not queue.empty():
                    batch.append(queue.get_nowait())
                try:
                    await self._apply([m for m, _ in batch])
                finally:
                    for _, done in batch:
                        done()
        finally:
            puller.cancel()
            await asyncio.gather(puller, return_exceptions=True)

    async def _recreate_consumer(self) -> None:
        name = self.spec.durable
        try:
            await self.js.delete_consumer(self.stream, name)
        except nats.js.errors.NotFoundError:
            pass
        start = (
            {"deliver_policy": DeliverPolicy.BY_START_SEQUENCE, "opt_start_seq": self.position + 1}
            if self.position
            else {"deliver_policy": DeliverPolicy.ALL}
        )
        await self.js.add_consumer(
            self.stream,
            ConsumerConfig(
                name=name,
                ack_policy=AckPolicy.NONE,
                filter_subject=self.filter,
                inactive_threshold=INACTIVE_S,
                **start,
            ),
        )
        self._consumer_seq = 0

    async def _apply(self, msgs: list[Msg]) -> None:
        consumer_seq = self._consumer_seq
        # Decided once per message, before any of the batch is applied: a retry of the batch one message at a
        # time applies the same ones.
        kept = [m for m in msgs if self.budget is None or self.budget.admit(m.subject, len(m.data))]
        try:
            letters = await self._apply_batch(msgs, kept, alone=False)
        except _Unplaced:
            self._consumer_seq = consumer_seq
            letters = await self._apply_batch(msgs, kept, alone=True)
        self.position = msgs[-1].metadata.sequence.stream
        POSITION.labels(self.stream).set(self.position)
        now = time.time()
        for msg in msgs:
            LAG.labels(self.stream).observe(max(now - msg.metadata.timestamp.timestamp(), 0.0))
        APPLIED.labels(self.stream, "applied").inc(len(kept) - len(letters))
        APPLIED.labels(self.stream, "dead_lettered").inc(len(letters))
        APPLIED.labels(self.stream, "over_budget").inc(len(msgs) - len(kept))

    async def _apply_batch(
        self, msgs: list[Msg], kept: list[Msg] | None = None, *, alone: bool
    ) -> list[tuple[Msg, PermanentError]]:
        """One transaction for the batch; `alone`: each message in a savepoint, those that fail dead-lettered.
        Without, the whole batch goes through one BatchProjection, and any failure rolls the whole transaction
        back (_Unplaced). Only `kept` (those within their host's budget) are applied; the position passes all."""
        kept = msgs if kept is None else kept
        self._check_sequence(msgs)
        messages = [Message(self.stream, m.metadata.sequence.stream, m.subject, m.data) for m in kept]
        letters: list[tuple[Msg, PermanentError]] = []
        async with self.pool.acquire() as conn, conn.transaction():
            repo: Projection
            if alone:
                repo = Projection(conn)
                for msg, message in zip(kept, messages, strict=True):
                    failure = await _failure(self._apply_alone(conn, repo, message))
                    if failure is not None:
                        letters.append((msg, failure))
            else:
                repo = BatchProjection(conn)
                if messages and await _failure(apply_batch(repo, messages)) is not None:
                    raise _Unplaced()
            await repo.cap_host_rows(self.host_rows_per_node)
            last = msgs[-1].metadata
            await repo.advance(self.stream, last.sequence.stream, last.timestamp)
            # Before the commit: a crash after it would lose them. Published again after a crash before it,
            # under the same derived event id, JetStream drops the copy.
            for msg, failure in letters:
                await self._dead_letter(msg, failure)
        return letters

    def _check_sequence(self, msgs: list[Msg]) -> None:
        for msg in msgs:
            seq = msg.metadata.sequence.consumer
            if seq != self._consumer_seq + 1:
                # A pull answer lost on the way (a reconnect): what was read stays uncommitted, and the
                # consumer is made again from the position.
                raise _Irregular(f"consumer sequence {seq} after {self._consumer_seq}")
            self._consumer_seq = seq

    @staticmethod
    async def _apply_alone(conn: asyncpg.Connection, repo: Projection, message: Message) -> None:
        async with conn.transaction():  # a savepoint: what a failed message wrote goes, the batch stays
            await apply(repo, message)

    async def _dead_letter(self, msg: Msg, failure: PermanentError) -> None:
        if self.stream == "DLQ":
            # A dead letter about a dead letter would be read again here: logged, never sent round.
            log.error(
                "dead_letter_unreadable", subject=msg.subject, reason_code=failure.reason_code, reason=failure.reason
            )
            return
        log.warning(
            "message_unplaceable",
            stream=self.stream,
            subject=msg.subject,
            reason_code=failure.reason_code,
            reason=failure.reason[:500],
        )
        await dead_letter(self.dead_letters, self.spec, msg, failure.reason_code, failure.reason, 1)


async def _failure(applying: Awaitable[None]) -> PermanentError | None:
    """Why what `applying` applies cannot be placed; None when it was."""
    try:
        await applying
    except PermanentError as exc:
        return exc
    except (*_UNPLACEABLE_DB, KeyError, TypeError, ValueError) as exc:
        return PermanentError("handler_error", f"{type(exc).__name__}: {exc}")
    return None
