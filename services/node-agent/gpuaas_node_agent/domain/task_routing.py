"""Which tasks this host's agent takes: each task type on its own subject, whose senders the contract names.

The server lets a service publish only the task subjects of the types the contract makes it the producer of
(contract.catalog's NODE_TASK_PREFIX, identity.permissions.produced_subjects), so the subject is the
authenticated part of a task and the envelope's `type` (and `producer`) is whatever the sender wrote. A task
whose type is not the one its subject carries came from a sender that may not send it (an image pipeline's
prewarm subject carrying a VM release, say), or from a sender that bypassed the rights (an admin's mistake):
it is refused unread, never acted on.
"""

from __future__ import annotations

from typing import Any

from gpuaas_common.contract.catalog import NODE_TASK_TYPES, node_task_subject


def misrouted_task(node_id: str, subject: str, body: Any) -> str | None:
    """Why this host refuses the task that came on `subject` (`body`: the decoded JSON), or None.

    A body that is no envelope with a type is left to the bus's own contract check (not JSON, schema)."""
    type_ = body.get("type") if isinstance(body, dict) else None
    if not isinstance(type_, str):
        return None
    if type_ not in NODE_TASK_TYPES:
        return f"{type_[:80]!r} is no node task type"
    expected = node_task_subject(type_, node_id)
    if subject != expected:
        return f"{type_} travels on {expected} only, and its senders publish there; this one came on {subject}"
    return None
