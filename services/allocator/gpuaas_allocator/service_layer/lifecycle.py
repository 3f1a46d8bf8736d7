"""Allocation state changes: the transition (checked against the table in domain/model.py), its timeline row
and its lifecycle event, in the handler's transaction; the one way an allocation fails; and the timeline note
that changes no state (an answer that came after the allocation ended)."""

from __future__ import annotations

from typing import Any

from gpuaas_common.bus import HandlerContext
from gpuaas_common.contract import caused_event_id
from gpuaas_common.contract import messages as m
from gpuaas_common.logging import get_logger

from ..domain.model import check_transition

log = get_logger(__name__)

LIFECYCLE_MODELS: dict[str, type[m.AllocationEvent]] = {
    "accepted": m.AllocationAccepted,
    "placed": m.AllocationPlaced,
    "unschedulable": m.AllocationUnschedulable,
    "provisioning": m.AllocationProvisioning,
    "active": m.AllocationActive,
    "releasing": m.AllocationReleasing,
    "released": m.AllocationReleased,
    "failed": m.AllocationFailed,
}


async def transition(
    ctx: HandlerContext,
    row: dict[str, Any],
    new_state: str,
    *,
    reason_code: str | None = None,
    detail: dict[str, Any] | None = None,
    update: dict[str, Any] | None = None,
    **event_fields: Any,
) -> dict[str, Any]:
    current = row["state"]
    check_transition(current, new_state)
    alloc_id = row["allocation_id"]
    seq = await ctx.uow.repos.change_state(
        alloc_id,
        new_state,
        current,
        fields=update or {},
        reason_code=reason_code,
        detail=detail,
        # The deadline sweep acts on no message: its changes have no causing event.
        cause_event_id=ctx.envelope.event_id if ctx.envelope is not None else None,
    )
    model = LIFECYCLE_MODELS[new_state]
    if reason_code is not None and "reason_code" in model.model_fields:
        event_fields.setdefault("reason_code", reason_code)
    event = model(
        allocation_id=alloc_id,
        tenant_id=row["tenant_id"],
        shape=row["shape"],
        state=new_state,
        previous_state=current,
        seq=seq,
        **event_fields,
    )
    await ctx.outbox.add(
        f"allocation.{new_state}",
        event,
        aggregate_id=str(alloc_id),
        # Redone after a lost commit (caused by another message) it is a new event; see caused_event_id. Under
        # the sequence number alone JetStream dropped it, and the scheduler, which had lost its own commit of the
        # first copy, kept the claims of a released allocation (a chaos run).
        event_id=caused_event_id(str(alloc_id), f"lifecycle:{seq}", ctx.envelope),
    )
    log.info("allocation_transition", allocation_id=str(alloc_id), from_state=current, to_state=new_state, seq=seq)
    new_row = dict(row)
    new_row.update(update or {})
    new_row["state"] = new_state
    return new_row


async def fail(
    ctx: HandlerContext,
    row: dict[str, Any],
    code: str,
    reason: str | None,
    node_id: str | None,
    *,
    cleanup_required: bool = True,
    wipe_proofs: list[m.WipeProof] | None = None,
    detail: dict[str, Any] | None = None,
) -> None:
    """The allocation failed; unless told the disk was never touched, it needs cleanup. Wipe proofs the host
    made are passed on for the scheduler, which owns the slots, to judge against the site's policy."""
    await transition(
        ctx,
        row,
        "failed",
        reason_code=code,
        detail=detail,
        update={"failure_code": code, "failure_reason": reason or code},
        reason=reason or code,
        node_id=node_id,
        cleanup_required=cleanup_required,
        wipe_proofs=wipe_proofs or [],
    )


async def note(
    ctx: HandlerContext, row: dict[str, Any], reason_code: str, detail: dict[str, Any], *, answered: bool = False
) -> None:
    """A timeline entry that changes no state and publishes nothing, for ops: e.g. a host's answer after the
    allocation ended. `answered`: it is the answer the allocation waited for, which it no longer does."""
    if answered:
        await ctx.uow.repos.update(row["allocation_id"], awaiting_result=False)
    await ctx.uow.repos.append_timeline(
        row["allocation_id"],
        row["state"],
        row["state"],
        reason_code=reason_code,
        detail=detail,
        # A sweep acts on no message: its notes have no causing event.
        cause_event_id=ctx.envelope.event_id if ctx.envelope is not None else None,
    )
