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

from collections.abc import Callable
from datetime import timedelta
from typing import Any

from gpuaas_common.bus import HandlerContext
from gpuaas_common.contract import caused_event_id, derived_event_id, utcnow
from gpuaas_common.logging import get_logger

from ..settings import AllocatorSettings
from .commands import maas_command_again, task_again
from .failed_machines import release_failed_machine
from .late_vms import give_up_late_vm_teardown
from .lifecycle import fail
from .redrive import reask_stalled_placements
from .sweeps import sweep_in_batches

log = get_logger(__name__)

TASK_DEADLINE_PASSED = "task_deadline_passed"
ENROLMENT_TIMEOUT = "enrolment_timeout"
SWEEP_CONSUMER = "allocator-task-deadlines"


async def sweep_deadlines(uow_factory: Callable[[], Any], settings: AllocatorSettings) -> None:
    """Every deadline the allocator owns: node tasks past theirs are asked again, then fail; placements and
    MAAS commands past theirs are asked again; deployed hosts that never enrolled fail."""
    await expire_overdue_tasks(uow_factory, settings)
    await reask_stalled_placements(uow_factory, settings)
    await reask_stalled_maas_commands(uow_factory, settings)
    await expire_unenrolled_hosts(uow_factory, settings)


async def expire_unenrolled_hosts(
    uow_factory: Callable[[], Any], settings: AllocatorSettings, *, batch: int = 50
) -> int:
    """Fail every baremetal allocation whose deployed host never enrolled within `enrolment_deadline_s`. Nobody
    can be asked again here: only the host enrols, and one that has not by then (no network, a broken image,
    credentials refused) needs ops, so the scheduler drains the node (cleanup required: the image is on it) and
    the machine is released through MAAS (failed_machines.py)."""

    async def expire(ctx: HandlerContext, row: dict[str, Any]) -> None:
        log.warning("enrolment_timeout", allocation_id=str(row["allocation_id"]), node_id=row["node_id"])
        reason = (
            f"MAAS deployed {row['maas_system_id']} but its host did not enrol within "
            f"{settings.enrolment_deadline_s:g} s"
        )
        await fail(ctx, row, ENROLMENT_TIMEOUT, reason, row["node_id"])
        await release_failed_machine(settings, ctx, row)  # deployed with the tenant's keys, reached by nobody

    return await sweep_in_batches(
        uow_factory,
        SWEEP_CONSUMER,
        lambda repos, limit: repos.lock_awaiting_enrolment(settings.enrolment_deadline_s, limit),
        expire,
        batch=batch,
    )


async def reask_stalled_maas_commands(
    uow_factory: Callable[[], Any], settings: AllocatorSettings, *, batch: int = 50
) -> int:
    """Send again the MAAS command of every baremetal allocation that waited `maas_reask_after_s` for its result.
    The gateway's own operation deadline ends every operation with a result; this only recovers a result whose
    commit was lost here (it was consumed, so JetStream will not deliver it again)."""

    async def reask(ctx: HandlerContext, row: dict[str, Any]) -> None:
        type_, cmd = maas_command_again(settings, row)
        await ctx.outbox.add(
            type_,
            cmd,
            aggregate_id=str(row["allocation_id"]),
            event_id=caused_event_id(cmd.operation_id, "maas-reask", None),  # a new message each asking
        )
        await ctx.uow.repos.update(row["allocation_id"], awaiting_result=True)  # restarts the wait
        log.warning("maas_command_reasked", allocation_id=str(row["allocation_id"]), operation_id=cmd.operation_id)

    return await sweep_in_batches(
        uow_factory,
        SWEEP_CONSUMER,
        lambda repos, limit: repos.lock_awaiting_maas(settings.maas_reask_after_s, limit),
        reask,
        batch=batch,
    )


async def expire_overdue_tasks(uow_factory: Callable[[], Any], settings: AllocatorSettings, *, batch: int = 50) -> int:
    """Time out every overdue task, batch by batch; the number timed out."""
    return await sweep_in_batches(
        uow_factory,
        SWEEP_CONSUMER,
        lambda repos, limit: repos.lock_overdue(settings.task_deadline_grace_s, limit),
        lambda ctx, row: expire_task(ctx, row, settings),
        batch=batch,
    )


async def reask_task(ctx: HandlerContext, row: dict[str, Any], settings: AllocatorSettings) -> None:
    """Send the overdue task once more under a new message id: an agent that ran it answers from its record
    (its answer, or our commit of it, was lost), one that never saw it refuses it as past its deadline before
    touching the disk, and one still running it answers when done. Only silence after that fails it."""
    type_, task = task_again(row)
    alloc_id = str(row["allocation_id"])
    await ctx.outbox.add(
        type_,
        task,
        aggregate_id=alloc_id,
        event_id=derived_event_id(f"{task.task_id}:{row['task_deadline_at'].isoformat()}", "task-reask"),
        node_id=row["node_id"],
    )
    await ctx.uow.repos.update(
        row["allocation_id"],
        task_reasked_at=utcnow(),
        task_deadline_at=utcnow() + timedelta(seconds=settings.task_reask_wait_s),
    )
    log.warning("task_reasked", allocation_id=alloc_id, task_id=task.task_id, node_id=row["node_id"])


async def expire_task(ctx: HandlerContext, row: dict[str, Any], settings: AllocatorSettings | None = None) -> None:
    if settings is not None and row.get("task_reasked_at") is None and row["shape"] == "gpu_slice":
        await reask_task(ctx, row, settings)
        return
    if row["state"] == "failed":
        # The teardown of a VM built after its allocation failed (late_vms.py): nothing left to fail.
        await give_up_late_vm_teardown(ctx, row)
        return
    task_id = row["release_task_id"] or row["task_id"]
    deadline = row["task_deadline_at"]
    await ctx.uow.repos.update(row["allocation_id"], awaiting_result=False, timed_out_task_id=task_id)
    log.warning(
        "task_deadline_passed",
        allocation_id=str(row["allocation_id"]),
        task_id=task_id,
        node_id=row["node_id"],
        deadline=str(deadline),
    )
    await fail(
        ctx,
        row,
        TASK_DEADLINE_PASSED,
        f"node {row['node_id']} did not answer task {task_id} by its deadline {deadline}; "
        "the disk may have been touched",
        row["node_id"],
        cleanup_required=True,
        detail={"task_id": task_id, "deadline": deadline.isoformat() if deadline else None},
    )
