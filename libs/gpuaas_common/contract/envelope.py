"""The event envelope every message on the bus carries.

The envelope travels in the JSON body (not only in headers) so that one JSON Schema in the contract
describes a whole message and a consumer can validate it without reading NATS headers.
"""

from __future__ import annotations

import uuid
from datetime import datetime, timezone
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

SCHEMA_VERSION = 1


def new_event_id() -> str:
    return str(uuid.uuid4())


def derived_event_id(cause_id: str, purpose: str) -> str:
    """A deterministic id for an event caused by another one.

    Re-processing the same cause yields the same id, so JetStream's Nats-Msg-Id dedup drops the copy
    even when no database row remembers that the event was already emitted.
    """
    return str(uuid.uuid5(uuid.NAMESPACE_URL, f"gpuaas:{cause_id}:{purpose}"))


def caused_event_id(key: str, purpose: str, cause: Envelope | None) -> str:
    """The id of the event `purpose` about `key` that handling the message `cause` produced.

    Handling the same message again (a redelivery) gives the same id, so JetStream keeps one copy; handling
    another message (a request asked again after a database lost the commit of the first answer) gives a new
    one, which JetStream must not drop as a duplicate of the lost work. Work no message caused (a sweep) is never
    redone by a redelivery, so it gets a fresh id.
    """
    return derived_event_id(f"{key}:{cause.event_id if cause is not None else uuid.uuid4()}", purpose)


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


class Envelope(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    event_id: str = Field(min_length=1, max_length=128)
    type: str = Field(min_length=1, max_length=128)
    schema_version: int = Field(ge=1)
    occurred_at: datetime
    correlation_id: str = Field(min_length=1, max_length=128)
    causation_id: str | None = Field(default=None, max_length=128)
    producer: str = Field(min_length=1, max_length=64)
    payload: dict[str, Any]

    @classmethod
    def wrap(
        cls,
        type_: str,
        payload: dict[str, Any],
        *,
        producer: str,
        correlation_id: str,
        causation_id: str | None = None,
        event_id: str | None = None,
    ) -> "Envelope":
        return cls(
            event_id=event_id or new_event_id(),
            type=type_,
            schema_version=SCHEMA_VERSION,
            occurred_at=utcnow(),
            correlation_id=correlation_id,
            causation_id=causation_id,
            producer=producer,
            payload=payload,
        )
