"""Answers to tasks the allocator gave up on; a VM built after its allocation failed, and its teardown.

A provision task given up on at its deadline (or abandoned by a forced release) can still succeed on the host:
its answer was late, not lost. The allocation stays failed — its slots wait for cleanup, or were freed by ops —
but the VM runs for nobody, holding the tenant's disk and the slot's GPU. The allocator sends it the ordinary
teardown (`slice.vm_release`, same id and wipe as a release), on the same deadline and one re-ask as any task;
the answer is recorded on the failed allocation's timeline for ops (the wipe proof included) and changes no
state: the slots' cleanup is ops' repair, which the proof informs.
"""

from __future__ import annotations

from typing import Any

from gpuaas_common.bus import HandlerContext
from gpuaas_common.contract import messages as m
from gpuaas_common.logging import get_logger

from .lifecycle import note

log = get_logger(__name__)

LATE_TASK_RESULT = "late_task_result_ignored"
LATE_VM_TORN_DOWN = "late_vm_torn_down"
LATE_VM_TEARDOWN_FAILED = "late_vm_teardown_failed"
LATE_VM_TEARDOWN_UNANSWERED = "late_vm_teardown_unanswered"


def late_vm_left_running(row: dict[str, Any], res: m.NodeTaskResult) -> bool:
    """Whether this late answer says a VM now runs that no allocation holds: a slice provision that succeeded
    for an allocation that failed before it heard so, and no teardown sent for it yet."""
    return (
        row["shape"] == "gpu_slice"
        and row["state"] == "failed"
        and res.task_id == row["task_id"]
        and res.task_type == "slice.vm_provision"
        and res.status == "succeeded"
        and row["release_task_id"] is None
    )


def _answer(res: m.NodeTaskResult) -> dict[str, Any]:
    """A host's task result as kept on the timeline."""
    return {
        "task_id": res.task_id,
        "node_id": res.node_id,
        "status": res.status,
        "reason_code": res.reason_code,
        "reason": res.reason,
        "cleanup_required": res.cleanup_required,
        "wipe_proofs": [p.model_dump(mode="json") for p in res.wipe_proofs],
    }


async def record_late_result(ctx: HandlerContext, row: dict[str, Any], res: m.NodeTaskResult) -> None:
    """The answer to a task given up on at its deadline (or abandoned by a forced release): kept, not applied."""
    log.warning("late_task_result_ignored", task_id=res.task_id, status=res.status, result_reason_code=res.reason_code)
    await note(ctx, row, LATE_TASK_RESULT, _answer(res))


async def record_late_vm_teardown(ctx: HandlerContext, row: dict[str, Any], res: m.NodeTaskResult) -> None:
    """The host's answer to the teardown of a late VM."""
    code = LATE_VM_TORN_DOWN if res.status == "succeeded" else LATE_VM_TEARDOWN_FAILED
    await note(ctx, row, code, _answer(res), answered=True)
    (log.info if res.status == "succeeded" else log.error)(
        code, task_id=res.task_id, node_id=res.node_id, status=res.status, result_reason_code=res.reason_code
    )


async def give_up_late_vm_teardown(ctx: HandlerContext, row: dict[str, Any]) -> None:
    """Asked twice, no answer: the host is gone or its agent is; what runs there is ops' to see (the host's
    own reconciler reports what it cannot account for once it is back)."""
    detail = {"task_id": row["release_task_id"], "node_id": row["node_id"]}
    await note(ctx, row, LATE_VM_TEARDOWN_UNANSWERED, detail, answered=True)
    log.error(LATE_VM_TEARDOWN_UNANSWERED, **detail)
