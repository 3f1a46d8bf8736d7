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

from collections.abc import Callable
from typing import Any

from gpuaas_common.bus import HandlerContext
from gpuaas_common.contract import derived_event_id
from gpuaas_common.contract import messages as m
from gpuaas_common.logging import get_logger

from ..settings import AllocatorSettings
from .sweeps import sweep_in_batches

log = get_logger(__name__)

PLACEMENT_REASKED = "placement_reasked"
EARLY_TASK_RESULT = "task_result_early"
EARLY_RESULT_MISMATCH = "early_task_result_mismatch"
SWEEP_CONSUMER = "allocator-placement-deadlines"


async def reask_placement(ctx: HandlerContext, row: dict[str, Any]) -> None:
    """Publish the allocation's placement request again (its `allocation.accepted` event, same seq)."""
    alloc = row["allocation_id"]
    asks = (row.get("placement_asks") or 0) + 1
    seq = await ctx.uow.repos.accepted_seq(alloc)
    request = m.AllocationAccepted(
        allocation_id=alloc,
        tenant_id=row["tenant_id"],
        shape=row["shape"],
        state="accepted",
        previous_state="requested",
        seq=seq or 1,
        sku=row["sku"],
        gpu_count=row["gpu_count"],
        region=row["region"],
        image=m.ImageRef(slug=row["image_slug"], digest_sha256=row["image_digest"], image_path=row["image_path"]),
    )
    await ctx.outbox.add(
        "allocation.accepted",
        request,
        aggregate_id=str(alloc),
        event_id=derived_event_id(str(alloc), f"placement-ask:{asks}"),
    )
    # Also restarts the wait: the next ask comes no sooner than another `placement_reask_after_s`.
    await ctx.uow.repos.update(alloc, placement_asks=asks)
    log.warning(PLACEMENT_REASKED, allocation_id=str(alloc), state=row["state"], asks=asks)


async def reask_stalled_placements(
    uow_factory: Callable[[], Any], settings: AllocatorSettings, *, batch: int = 50
) -> int:
    """Re-ask every placement overdue by `placement_reask_after_s`; how many were re-asked."""
    return await sweep_in_batches(
        uow_factory,
        SWEEP_CONSUMER,
        lambda repos, limit: repos.lock_awaiting_placement(settings.placement_reask_after_s, limit),
        reask_placement,
        batch=batch,
    )


async def hold_early_result(ctx: HandlerContext, row: dict[str, Any], res: m.NodeTaskResult) -> None:
    """Keep a result for a provision task the allocation does not know yet, and re-ask its placement now."""
    kept = await ctx.uow.repos.keep_early_result(
        res.allocation_id, res.task_id, res.node_id, res.model_dump(mode="json"), ctx.envelope.event_id
    )
    log.warning(
        EARLY_TASK_RESULT, task_id=res.task_id, node_id=res.node_id, status=res.status, state=row["state"], kept=kept
    )
    if not kept:
        return  # a copy of a result already kept: its re-ask is out
    await ctx.uow.repos.append_timeline(
        res.allocation_id,
        row["state"],
        row["state"],
        reason_code=EARLY_TASK_RESULT,
        detail={"task_id": res.task_id, "node_id": res.node_id, "status": res.status, "reason_code": res.reason_code},
        cause_event_id=ctx.envelope.event_id,
    )
    await reask_placement(ctx, row)
