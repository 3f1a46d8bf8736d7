"""A throwaway durable for a test that drives the bus plumbing on a shared stream."""

from __future__ import annotations

import uuid
from typing import Any

from nats.js.api import DeliverPolicy

from gpuaas_common.jetstream import ConsumerSpec


async def durable_at_end(
    js: Any,
    prefix: str,
    subject: str,
    *,
    stream: str = "ALLOCATIONS",
    ack_wait_s: float = 30.0,
    max_deliver: int = 3,
) -> ConsumerSpec:
    """A new durable on `subject` that starts after every message already in the stream, so a test never
    replays what another test published there."""
    spec = ConsumerSpec(
        f"{prefix}-{uuid.uuid4().hex[:8]}", stream, subject, max_deliver=max_deliver, ack_wait_s=ack_wait_s
    )
    config = spec.config()
    config.deliver_policy = DeliverPolicy.BY_START_SEQUENCE
    config.opt_start_seq = (await js.stream_info(stream)).state.last_seq + 1
    await js.add_consumer(stream, config)
    return spec
