"""Node-task deadlines owned by the control plane.

The agent enforces a task's deadline itself, but a host that vanished (power, network, a dead agent) never
answers, and the allocation would wait forever. Past the deadline plus a grace the task is first sent once
more (same task id: the agent answers from its record, so an answer whose commit was lost here is not lost),
then, after `task_reask_wait_s` more of silence, the sweep fails the allocation with
`task_deadline_passed` once the deadline plus a grace has passed. The disk may have been touched, so the
failure says `cleanup_required`: the scheduler keeps the claims and moves the slots to `cleanup_blocked`
(slice-implementation-checklist: "Slice slots attached to a failed provisioning attempt move to
cleanup_blocked, not available"). The task is remembered as `timed_out_task_id`; an answer that arrives
later is recorded on the timeline and changes nothing (`Allocator.on_task_result`).

Allocations that wait for a placement answer have a deadline too: past it, the placement is asked again
(redrive.py). Replicas share the work: the overdue rows are taken with `FOR UPDATE SKIP LOCKED`, in one unit of work
per batch, so a row is timed out once and never while a handler holds it.
"""

from __future__ import annotations

from ..domain.allocation import ENROLMENT_TIMEOUT, TASK_DEADLINE_PASSED, Allocation
from ..settings import AllocatorSettings
from .commands import policy_of
from .ports import AllocatorUnitOfWork, UnitOfWorkFactory
from .redrive import reask_stalled_placements
from .sweeps import sweep_in_batches

__all__ = ["ENROLMENT_TIMEOUT", "TASK_DEADLINE_PASSED", "sweep_deadlines"]


async def sweep_deadlines(uow_factory: UnitOfWorkFactory, settings: AllocatorSettings) -> None:
    """Every deadline the allocator owns: node tasks past theirs are asked again, then fail; placements and
    MAAS commands past theirs are asked again; deployed hosts that never enrolled fail."""
    await expire_overdue_tasks(uow_factory, settings)
    await reask_stalled_placements(uow_factory, settings)
    await reask_stalled_maas_commands(uow_factory, settings)
    await expire_unenrolled_hosts(uow_factory, settings)


async def expire_unenrolled_hosts(
    uow_factory: UnitOfWorkFactory, settings: AllocatorSettings, *, batch: int = 50
) -> int:
    """Fail every baremetal allocation whose deployed host never enrolled within `enrolment_deadline_s`. Nobody
    can be asked again here: only the host enrols, and one that has not by then (no network, a broken image,
    credentials refused) needs ops, so the scheduler drains the node (cleanup required: the image is on it) and
    the machine is released through MAAS."""

    async def expire(uow: AllocatorUnitOfWork, alloc: Allocation) -> None:
        alloc.expire_enrolment(settings.enrolment_deadline_s)

    return await sweep_in_batches(
        uow_factory,
        policy_of(settings),
        lambda repos, limit: repos.lock_awaiting_enrolment(settings.enrolment_deadline_s, limit),
        expire,
        batch=batch,
    )


async def reask_stalled_maas_commands(
    uow_factory: UnitOfWorkFactory, settings: AllocatorSettings, *, batch: int = 50
) -> int:
    """Send again the MAAS command of every baremetal allocation that waited `maas_reask_after_s` for its result.
    The gateway's own operation deadline ends every operation with a result; this only recovers a result whose
    commit was lost here (it was consumed, so JetStream will not deliver it again)."""

    async def reask(uow: AllocatorUnitOfWork, alloc: Allocation) -> None:
        alloc.reask_maas_command()

    return await sweep_in_batches(
        uow_factory,
        policy_of(settings),
        lambda repos, limit: repos.lock_awaiting_maas(settings.maas_reask_after_s, limit),
        reask,
        batch=batch,
    )


async def expire_overdue_tasks(uow_factory: UnitOfWorkFactory, settings: AllocatorSettings, *, batch: int = 50) -> int:
    """Ask every overdue task once more, or time it out, batch by batch; how many were acted on."""

    async def expire(uow: AllocatorUnitOfWork, alloc: Allocation) -> None:
        alloc.expire_task()

    return await sweep_in_batches(
        uow_factory,
        policy_of(settings),
        lambda repos, limit: repos.lock_overdue(settings.task_deadline_grace_s, limit),
        expire,
        batch=batch,
    )
