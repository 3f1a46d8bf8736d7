"""Re-drive instead of ignore: when the allocator has lost track of an allocation, it asks the service that
holds the truth again, idempotently, and converges when the answer comes.

Placement: an allocation that waits for its placement answer (state `accepted`, or `releasing` before it was
placed) longer than `placement_reask_after_s` re-publishes its `allocation.accepted` event, the scheduler's
placement request, with the same fields and sequence number under an event id of its own. The scheduler
answers with the claim it already holds (the same node, slots and fencing epoch), or places it if it holds
none; an answer the allocator no longer needs is ignored by `on_placed` like any duplicate.

Early task results: when the allocator's commits of `placed`/`provisioning` are lost (an immediate Postgres
restart without synchronous_commit, a promoted asynchronous replica) after the outbox had already sent the
provision task, the agent's result arrives for a task the allocator has no record of. Its id names the
allocation (`prov-<allocation_id>`), so it is kept in `early_task_results` and the placement is re-asked at once;
when the placement answer is applied and the task is known again, `Allocator.on_placed` applies the kept result.
"""

from __future__ import annotations

from gpuaas_common.contract import messages as m
from gpuaas_common.logging import get_logger

from ..domain.allocation import EARLY_RESULT_MISMATCH, EARLY_TASK_RESULT, PLACEMENT_REASKED, Allocation
from ..settings import AllocatorSettings
from .commands import policy_of, save
from .ports import AllocatorUnitOfWork, UnitOfWorkFactory
from .sweeps import sweep_in_batches

__all__ = ["EARLY_RESULT_MISMATCH", "EARLY_TASK_RESULT", "PLACEMENT_REASKED", "hold_early_result"]

log = get_logger(__name__)


async def reask_stalled_placements(
    uow_factory: UnitOfWorkFactory, settings: AllocatorSettings, *, batch: int = 50
) -> int:
    """Re-ask every placement overdue by `placement_reask_after_s`; how many were re-asked."""

    async def reask(uow: AllocatorUnitOfWork, alloc: Allocation) -> None:
        alloc.reask_placement(await uow.repos.accepted_seq(alloc.allocation_id))

    return await sweep_in_batches(
        uow_factory,
        policy_of(settings),
        lambda repos, limit: repos.lock_awaiting_placement(settings.placement_reask_after_s, limit),
        reask,
        batch=batch,
    )


async def hold_early_result(uow: AllocatorUnitOfWork, alloc: Allocation, res: m.NodeTaskResult, event_id: str) -> None:
    """Keep a result for a provision task the allocation does not know yet, and re-ask its placement now.
    `event_id`: the result's message."""
    kept = await uow.repos.keep_early_result(
        res.allocation_id, res.task_id, res.node_id, res.model_dump(mode="json"), event_id
    )
    log.warning(
        EARLY_TASK_RESULT, task_id=res.task_id, node_id=res.node_id, status=res.status, state=alloc.state, kept=kept
    )
    if not kept:
        return  # a copy of a result already kept: its re-ask is out
    alloc.hold_early_result(res, await uow.repos.accepted_seq(alloc.allocation_id))
    await save(uow, alloc)
