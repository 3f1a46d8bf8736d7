"""Asking the allocator, which owns allocations, what it knows of some of them (`allocation.query`, core
request/reply, with the scheduler's own bus identity)."""

from __future__ import annotations

import uuid
from collections.abc import Sequence

import nats.errors

from gpuaas_common.allocation_queries import ask_allocator
from gpuaas_common.contract import messages as m
from gpuaas_common.logging import get_logger

log = get_logger(__name__)

# The contract's most ids one query may name.
MAX_IDS = 1000


class AllocatorClient:
    def __init__(self, nc, timeout_s: float) -> None:
        self.nc = nc
        self.timeout_s = timeout_s

    async def states(self, ids: Sequence[uuid.UUID]) -> dict[uuid.UUID, m.AllocationSummary] | None:
        """The allocator's summary of each id it knows (an id it never accepted is absent); None when it gave
        no usable answer (not running, too slow, or the answer broke the contract): ask again later."""
        out: dict[uuid.UUID, m.AllocationSummary] = {}
        for start in range(0, len(ids), MAX_IDS):
            chunk = list(ids[start : start + MAX_IDS])
            query = m.AllocationQuery(allocation_ids=chunk, limit=len(chunk))
            try:
                result = await ask_allocator(
                    self.nc, query, producer="scheduler", correlation_id="claim-audit", timeout_s=self.timeout_s
                )
            except (nats.errors.NoRespondersError, nats.errors.TimeoutError, nats.errors.ConnectionClosedError) as exc:
                log.warning("allocator_query_unanswered", error=type(exc).__name__)
                return None
            except ValueError as exc:
                log.warning("allocator_query_bad_answer", error=str(exc)[:300])
                return None
            if result.status != "found" or result.truncated:
                log.warning("allocator_query_refused", status=result.status, reason=result.reason)
                return None
            out.update({a.allocation_id: a for a in result.allocations})
        return out
