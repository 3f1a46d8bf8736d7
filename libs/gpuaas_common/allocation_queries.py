"""Asking the allocator about allocations (`allocation.query`, core request/reply): the one way every asker —
the CLI for ops, the scheduler's claim audit — sends the question and reads the answer."""

from __future__ import annotations

import json

from .contract import Envelope, spec_for
from .contract import messages as m


async def ask_allocator(
    nc, query: m.AllocationQuery, *, producer: str, correlation_id: str, timeout_s: float
) -> m.AllocationQueryResult:
    """The allocator's answer, validated against the contract. nats errors (no responder, timeout) are the
    caller's to word; an answer that breaks the contract raises ValueError (pydantic's ValidationError is one)."""
    env = Envelope.wrap(
        "allocation.query", query.model_dump(mode="json"), producer=producer, correlation_id=correlation_id
    )
    msg = await nc.request(spec_for("allocation.query").subject(), env.model_dump_json().encode(), timeout=timeout_s)
    answer = Envelope.model_validate(json.loads(msg.data))
    if answer.type != "allocation.query_result":
        raise ValueError(f"the allocator answered with {answer.type}")
    return m.AllocationQueryResult.model_validate(answer.payload)
