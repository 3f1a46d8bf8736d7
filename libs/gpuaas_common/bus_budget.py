"""What one host may make a consumer do: a rate and size budget per node, applied where its messages are read.

The bus enforces no message rate for its users, and every host-fed consumer turns a message into work and
usually a row. So each durable that reads host-produced subjects (`gpuaas.node.<id>.report.*`) declares itself
host-fed (`Bus.subscribe(..., host_budget=...)`, the ops-view followers likewise) and gives every node two token
buckets: messages per minute and bytes per minute, each refilled continuously and holding at most one minute's
worth (a burst of a minute's budget, then the steady rate). A message over either budget is acknowledged and
dropped before it is parsed: nothing of it is applied, so it is never half-applied, and it is not redelivered.
Each drop is counted (`gpuaas_host_messages_dropped_total` by consumer) and logged once per node per window
(`host_over_budget` at the window's first drop, with the previous window's count and the node's total), so a
flood costs one log line a minute, not one a message.

What a node's admitted messages leave behind is capped too: each one's inbox row names the node (`inbox_of`),
and the consumer keeps that node's newest `inbox_rows_per_node` (`inbox.HostInbox`). The budget bounds how fast a
host grows the inbox, the cap how far: however long it keeps sending, one consumer holds at most that many rows
of it (one cap for all replicas: the rows are shared), where an inbox row otherwise lives 8 days.

Replicas: the buckets live in each process. Replicas of a service share a durable, so each sees part of a
node's messages and the budget a node has with a service is the per-replica budget times its replica count.
Size the settings as (the budget wanted) / (replicas) where that matters; a budget is a bound on the damage,
not an exact quota.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import Counter

from .inbox import HostInbox
from .logging import get_logger
from .settings import ServiceSettings

log = get_logger(__name__)

DROPPED = Counter(
    "gpuaas_host_messages_dropped_total",
    "Host messages acknowledged and dropped over their node's budget",
    ["consumer"],
)

HOST_SUBJECT_PREFIX = "gpuaas.node."
# Where agents used to dead-letter their task messages (bodies and all); they report a count now, and what still
# arrives there is refused: a budget of zero (`HostBudget.refusing`).
HOST_DLQ_PREFIX = "gpuaas.dlq.node-agent-"
# How many nodes' buckets one consumer keeps; past it the fullest (longest idle) are forgotten, so a flood of
# forged node ids in subjects cannot grow the process either. Hosts publish only on their own subjects, so in
# practice this is the fleet size.
MAX_TRACKED_NODES = 100_000
# The deployment's `GPUAAS_HOST_ROWS_PER_NODE` where no runtime sets it (tests, tools).
HOST_ROWS_PER_NODE: int = ServiceSettings.model_fields["host_rows_per_node"].default


def host_of(subject: str) -> str | None:
    """The node a host-produced subject belongs to (`gpuaas.node.<id>.report.<kind>`, or a host's dead-letter
    subject `gpuaas.dlq.node-agent-<id>`), else None."""
    if subject.startswith(HOST_DLQ_PREFIX):
        return subject[len(HOST_DLQ_PREFIX) :] or None
    if not subject.startswith(HOST_SUBJECT_PREFIX):
        return None
    parts = subject.split(".", 4)
    if len(parts) < 5 or parts[3] != "report" or not parts[2]:
        return None
    return parts[2]


@dataclass
class _Bucket:
    messages: float
    bytes: float
    at: float
    # The window's drops, and when the window began (0: no drop yet in it).
    dropped: int = 0
    window_start: float = 0.0


class HostBudget:
    """Token buckets per node for one consumer. `admit(subject, size)` says whether a message may be handled;
    one that may not is the caller's to acknowledge and drop. Subjects that are not a host's pass."""

    def __init__(
        self,
        consumer: str,
        *,
        messages_per_min: float,
        bytes_per_min: float,
        window_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
        inbox_rows_per_node: int = HOST_ROWS_PER_NODE,
    ) -> None:
        if messages_per_min < 0 or bytes_per_min < 0:
            raise ValueError("a host budget cannot be negative")
        if inbox_rows_per_node < 1:
            raise ValueError("a host's inbox group keeps at least one row")
        self.inbox_rows_per_node = inbox_rows_per_node
        self.consumer = consumer
        self.messages_per_min = float(messages_per_min)
        self.bytes_per_min = float(bytes_per_min)
        self.window_s = window_s
        self.clock = clock
        self._buckets: dict[str, _Bucket] = {}
        # Dropped per node since start; what a test or an operator reads.
        self.dropped: dict[str, int] = {}

    @classmethod
    def refusing(cls, consumer: str) -> HostBudget:
        """Drops every host message (counted and logged like any over budget): for what hosts may no longer send."""
        return cls(consumer, messages_per_min=0, bytes_per_min=0)

    def admit(self, subject: str, size: int) -> bool:
        node = host_of(subject)
        if node is None:
            return True
        now = self.clock()
        bucket = self._buckets.get(node)
        if bucket is None:
            if len(self._buckets) >= MAX_TRACKED_NODES:
                self._forget_idle(now)
            bucket = self._buckets[node] = _Bucket(self.messages_per_min, self.bytes_per_min, now)
        else:
            self._refill(bucket, now)
        if bucket.messages >= 1.0 and bucket.bytes >= size:
            bucket.messages -= 1.0
            bucket.bytes -= size
            return True
        self._drop(node, bucket, now, size)
        return False

    def inbox_of(self, subject: str) -> HostInbox | None:
        """Where an admitted message's inbox row goes: its node's capped group; None for a subject not a host's."""
        node = host_of(subject)
        return None if node is None else HostInbox(node, self.inbox_rows_per_node)

    def _refill(self, bucket: _Bucket, now: float) -> None:
        elapsed = max(now - bucket.at, 0.0)
        bucket.at = now
        bucket.messages = min(self.messages_per_min, bucket.messages + elapsed * self.messages_per_min / 60.0)
        bucket.bytes = min(self.bytes_per_min, bucket.bytes + elapsed * self.bytes_per_min / 60.0)

    def _drop(self, node: str, bucket: _Bucket, now: float, size: int) -> None:
        DROPPED.labels(self.consumer).inc()
        self.dropped[node] = self.dropped.get(node, 0) + 1
        if not bucket.window_start or now - bucket.window_start >= self.window_s:
            # The one line of this node's window; it carries the previous window's count.
            log.warning(
                "host_over_budget",
                consumer=self.consumer,
                node_id=node,
                size=size,
                dropped_previous_window=bucket.dropped,
                dropped_total=self.dropped[node],
                messages_per_min=self.messages_per_min,
                bytes_per_min=self.bytes_per_min,
                window_s=self.window_s,
            )
            bucket.window_start = now
            bucket.dropped = 0
        bucket.dropped += 1

    def _forget_idle(self, now: float) -> None:
        for node, bucket in list(self._buckets.items()):
            self._refill(bucket, now)
            quiet = not bucket.window_start or now - bucket.window_start >= self.window_s
            if bucket.messages >= self.messages_per_min and quiet:
                del self._buckets[node]
        if len(self._buckets) >= MAX_TRACKED_NODES:
            # Everyone is busy: forgetting one hands it a fresh minute, which bounds memory, not its rate.
            self._buckets.pop(next(iter(self._buckets)))
