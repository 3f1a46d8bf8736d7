"""How an allocation's recorded changes leave the unit of work: its rows through the repository, its commands
(node tasks, MAAS commands) and lifecycle events through the outbox. The commands themselves are built in
domain/commands.py, from the allocation's record, whether sent first or asked again."""

from __future__ import annotations

from typing import Any

from ..domain.allocation import Allocation
from ..domain.commands import Policy, provision_task_id, release_task_id
from ..settings import AllocatorSettings

__all__ = ["policy_of", "provision_task_id", "release_task_id", "save"]


def policy_of(settings: AllocatorSettings) -> Policy:
    return Policy(
        enrolment_secret=settings.enrolment_secret,
        task_deadline_s=settings.task_deadline_s,
        task_reask_wait_s=settings.task_reask_wait_s,
        maas_site=settings.maas_site,
        baremetal_profile=settings.baremetal_profile,
    )


async def save(uow: Any, alloc: Allocation) -> None:
    """Write the allocation and queue its messages, in `uow` (a handler's or a sweep's unit of work)."""
    await uow.repos.save(alloc)
    aggregate_id = str(alloc.allocation_id)
    for out in alloc.events:
        await uow.events.add(out.type, out.payload, aggregate_id=aggregate_id, event_id=out.event_id, **out.subject)
    alloc.events = []
