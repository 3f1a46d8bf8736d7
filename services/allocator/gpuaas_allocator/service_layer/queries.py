"""Answers to `allocation.query`: the allocator owns the allocations, so it is the one that reads them out.

Read-only and outside any unit of work; the request and its answer travel over core NATS request/reply,
so a portal or an operator reads allocations with its bus identity, not with database credentials.
"""

from __future__ import annotations

from typing import Any

from gpuaas_common.contract import messages as m

from .ports import ReadsFactory


async def answer_query(reads: ReadsFactory, query: m.AllocationQuery) -> m.AllocationQueryResult:
    """`reads`: both reads of one answer on one connection (adapters/repository.py, `allocation_reads`)."""
    async with reads() as reader:
        rows = await reader.find_allocations(
            allocation_id=query.allocation_id,
            tenant_id=query.tenant_id,
            state=query.state,
            node_id=query.node_id,
            allocation_ids=query.allocation_ids,
            limit=query.limit,
        )
        if query.allocation_id is not None and not rows:
            return m.AllocationQueryResult(status="not_found", reason=f"no allocation {query.allocation_id}")
        timeline: list[dict[str, Any]] = []
        if query.allocation_id is not None:
            timeline = await reader.timeline_of(query.allocation_id)
    return m.AllocationQueryResult(
        status="found",
        allocations=[m.AllocationSummary.model_validate(r) for r in rows[: query.limit]],
        timeline=[m.TimelineEntry.model_validate(t) for t in timeline],
        truncated=len(rows) > query.limit,
    )
