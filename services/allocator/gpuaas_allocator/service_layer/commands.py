"""How an allocation's recorded changes leave the unit of work: its rows through the repository, its commands
(node tasks, MAAS commands) and lifecycle events through the outbox. The commands themselves are built in
domain/commands.py, from the allocation's record, whether sent first or asked again."""

from __future__ import annotations

from prometheus_client import Histogram

from ..domain.allocation import PROVISION_PHASE, Allocation
from ..domain.commands import Policy, provision_task_id, release_task_id
from ..settings import AllocatorSettings
from .ports import AllocatorUnitOfWork

__all__ = ["policy_of", "provision_task_id", "release_task_id", "save"]


def policy_of(settings: AllocatorSettings) -> Policy:
    return Policy(
        enrolment_secret=settings.enrolment_secret,
        task_deadline_s=settings.task_deadline_s,
        task_reask_wait_s=settings.task_reask_wait_s,
        maas_site=settings.maas_site,
        baremetal_profile=settings.baremetal_profile,
    )


# The provisioning phases each allocation records on its timeline (a slice host's clone, boot, lease...; a
# baremetal walk's allocate, deploy, first boot, enrolment, active), as a distribution for baselines and alerts.
# Observed as the unit of work is written: a unit of work that then fails to commit is redone by its message's
# redelivery, so a phase can be counted twice, never lost.
PHASE_SECONDS = Histogram(
    "gpuaas_allocation_phase_seconds",
    "Seconds an allocation spent in each provisioning phase",
    ["shape", "phase"],
    buckets=(0.5, 1, 2, 5, 10, 20, 30, 60, 120, 180, 300, 600, 900, 1800, 3600),
)


async def save(uow: AllocatorUnitOfWork, alloc: Allocation) -> None:
    """Write the allocation and queue its messages, in `uow` (a handler's or a sweep's unit of work)."""
    for entry in alloc.timeline:
        if entry.reason_code == PROVISION_PHASE and entry.detail:
            PHASE_SECONDS.labels(alloc.shape, entry.detail["phase"]).observe(entry.detail["seconds"])
    await uow.repos.save(alloc)
    aggregate_id = str(alloc.allocation_id)
    for out in alloc.events:
        await uow.events.add(out.type, out.payload, aggregate_id=aggregate_id, event_id=out.event_id, **out.subject)
    alloc.events = []
