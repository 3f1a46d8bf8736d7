"""A slice task's phases and its result: each phase recorded (with whether the disk was touched) and published
as progress; the result built from the task's record."""

from __future__ import annotations

from typing import Any

from gpuaas_common.contract import TaskType, derived_event_id
from gpuaas_common.contract import messages as m

from .context import HostContext, log

PROGRESS_PUBLISH_TIMEOUT_S = 1.0


def result(
    ctx: HostContext,
    task: Any,
    task_type: str,
    status: str,
    *,
    code: str | None = None,
    reason: str | None = None,
    cleanup_required: bool = False,
    readiness_: m.Readiness | None = None,
    proofs: list[m.WipeProof] | None = None,
    stop_path: str | None = None,
) -> m.NodeTaskResult:
    # A release follows a VM that had its disks, so only a provision can say it never wrote one, and only
    # from the record `enter` writes before the first write.
    record = ctx.store.task(task.task_id)
    touched = task_type != TaskType.SLICE_VM_PROVISION or bool(record and record["disk_touched"])
    return m.NodeTaskResult(
        task_id=task.task_id,
        allocation_id=task.allocation_id,
        node_id=ctx.node_id,
        task_type=task_type,
        status=status,
        reason_code=code,
        reason=reason,
        readiness=readiness_,
        wipe_proofs=proofs or [],
        cleanup_required=cleanup_required,
        disk_touched=touched,
        stop_path=stop_path,  # type: ignore[arg-type]  # ShutdownPath's values, checked by the contract
    )


async def enter(
    ctx: HostContext, task: Any, task_type: str, phase: str, *, disk_touched: bool = False, detail: str | None = None
) -> None:
    ctx.store.set_phase(task.task_id, phase, disk_touched=disk_touched)
    log.info("task_phase", task_id=task.task_id, allocation_id=str(task.allocation_id), phase=phase, detail=detail)
    try:
        await _publish_progress(ctx, task, task_type, phase, detail)
    except Exception as exc:  # noqa: BLE001 - progress is for people watching; the result is what counts
        # E.g. a JetStream publish timing out while the stream elects a new leader: the task goes on.
        log.warning("task_progress_not_published", task_id=task.task_id, phase=phase, error=repr(exc))


async def _publish_progress(ctx: HostContext, task: Any, task_type: str, phase: str, detail: str | None) -> None:
    await ctx.publish(
        "node.task_progress",
        m.NodeTaskProgress(
            task_id=task.task_id,
            allocation_id=task.allocation_id,
            node_id=ctx.node_id,
            task_type=task_type,
            phase=phase,
            detail=detail,
        ),
        correlation_id=str(task.allocation_id),
        event_id=derived_event_id(task.task_id, f"phase:{phase}"),
        # Progress is for people watching. While a stream elects a new leader after a NATS server died
        # (4-9 s), a publish gets no PubAck: at the usual 5 s each phase of the task waited that long
        # (a chaos run saw tasks held up ~15 s); at 1 s the task goes on, and only its result waits for a PubAck.
        timeout=PROGRESS_PUBLISH_TIMEOUT_S,
        node_id=ctx.node_id,
    )
