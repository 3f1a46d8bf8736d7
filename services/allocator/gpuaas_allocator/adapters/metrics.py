"""The allocator's readings for /metrics (`gpuaas_common.metrics`): allocations by state and shape, and how long the
oldest live one of each has been in its state, read from its own tables when it is scraped. Time spent in each
state, as a distribution, is observed as allocations move (`TIME_IN_STATE`, repository.py)."""

from __future__ import annotations

from typing import Any

from prometheus_client import Counter, Histogram

from gpuaas_common.metrics import Family, Reading, Sample, seconds

from ..domain.model import SKUS, TRANSITIONS

STATES = tuple(TRANSITIONS)
LIVE_STATES = tuple(s for s, nxt in TRANSITIONS.items() if nxt)
SHAPES = tuple(sorted({shape for shape, _ in SKUS.values()}))

ALLOCATIONS = Family("gpuaas_allocations", "Allocations in each state, by shape", ("state", "shape"))
OLDEST_IN_STATE = Family(
    "gpuaas_allocation_oldest_in_state_seconds",
    "How long the oldest allocation in a live state has been in it (0 when none is)",
    ("state", "shape"),
)

# From the moment an allocation entered a state to the one it left it, by the allocator's unit-of-work clock.
# Observed as the move is written; a unit of work that then fails to commit is redone by its message's
# redelivery, so a move can be counted twice, never lost.
TIME_IN_STATE = Histogram(
    "gpuaas_allocation_state_seconds",
    "Seconds an allocation spent in a state before it moved on",
    ["shape", "state"],
    buckets=(0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600, 1200, 1800, 3600, 7200, 21600, 86400, 604800),
)

# When an allocation entered its current state: the timeline row of the move into it (rows that note a phase or
# a result inside a state name it as their previous state too).
STATE_ENTERED_SQL = (
    "SELECT max(t.at) FROM allocation_timeline t WHERE t.allocation_id = a.allocation_id "
    "AND t.state = a.state AND t.previous_state IS DISTINCT FROM t.state"
)


def allocations_reading(pool: Any) -> Reading:
    """Every (state, shape) pair is sampled, 0 where there is none, so an alert on it never reads 'no data'."""

    async def read() -> list[Sample]:
        async with pool.acquire() as conn:
            counts = await conn.fetch("SELECT state, shape, count(*) AS n FROM allocations GROUP BY state, shape")
            oldest = await conn.fetch(
                f"SELECT a.state, a.shape, max(EXTRACT(EPOCH FROM clock_timestamp() - ({STATE_ENTERED_SQL}))) AS age "
                "FROM allocations a WHERE a.state = ANY($1::text[]) GROUP BY a.state, a.shape",
                list(LIVE_STATES),
            )
        n = {(r["state"], r["shape"]): r["n"] for r in counts}
        age = {(r["state"], r["shape"]): seconds(r["age"]) for r in oldest}
        grid = [(state, shape) for state in STATES for shape in SHAPES]
        out = [ALLOCATIONS(state, shape, value=n.get((state, shape), 0)) for state, shape in grid]
        out += [ALLOCATIONS(state, shape, value=v) for (state, shape), v in n.items() if (state, shape) not in grid]
        out += [
            OLDEST_IN_STATE(state, shape, value=age.get((state, shape), 0.0))
            for state in LIVE_STATES
            for shape in SHAPES
        ]
        return out

    return read


# Queries whose reply subject is no asker's own inbox (entrypoints/main.py answerable_reply): left unanswered.
QUERIES_REFUSED = Counter(
    "gpuaas_allocator_queries_refused_total",
    "allocation.query requests left unanswered because their reply subject is no asker's own inbox",
)
