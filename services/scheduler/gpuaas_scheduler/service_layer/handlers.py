"""Scheduler handlers: place accepted allocations, follow their lifecycle, free what they held.

Replicas: every lifecycle handler first takes the allocation's lock (`inv.lock_allocation`; the bus takes it
with the BEGIN, `allocation_first_lock`), so two
messages about one allocation handled by two replicas at once run one after the other, as they do in one
process's keyed lane. They may still run in either order; each one checks the slots' status and a
message whose predecessor has not been applied yet is retried (`ArrivedEarly`, `EndedOutOfOrder`), never
applied out of order or dropped.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence

import asyncpg

from gpuaas_common.bus import HandlerContext
from gpuaas_common.contract import caused_event_id, derived_event_id
from gpuaas_common.contract import messages as m
from gpuaas_common.logging import get_logger

from ..adapters import inventory as inv
from ..adapters.inventory.held import held_placement
from ..domain.approval import wipe_verdict
from ..domain.slots import allowed_from
from . import drift, evidence, host_modes, steering
from .placement import PlacementPolicy, place

log = get_logger(__name__)


def allocation_first_lock(payload: object) -> str | None:
    """The lock every handler of the lifecycle consumer takes first, for the bus to take with the BEGIN."""
    allocation_id = getattr(payload, "allocation_id", None)
    return inv.allocation_lock_key(allocation_id) if allocation_id is not None else None


async def _lock_allocation(ctx: HandlerContext, allocation_id: uuid.UUID) -> None:
    if not ctx.uow.holds_lock(inv.allocation_lock_key(allocation_id)):
        await inv.lock_allocation(ctx.conn, allocation_id)


class Scheduler:
    def __init__(self, policy: PlacementPolicy | None = None) -> None:
        self.policy = policy or PlacementPolicy()

    async def on_accepted(self, ctx: HandlerContext) -> None:
        ev: m.AllocationAccepted = ctx.payload
        alloc_id = str(ev.allocation_id)
        # A placement asked again (re-drive) while another replica places the first request: without the
        # lock both see no claim and both place.
        await _lock_allocation(ctx, ev.allocation_id)
        outcome = await place(ctx.conn, ev, self.policy)
        if outcome.already_placed:
            # A repeated request: the allocator lost track of our answer and asks again. Answer with the claim
            # held, under an id of this request's own (the first answer's id would be dropped as a duplicate).
            again = await held_placement(ctx.conn, ev.allocation_id)
            if again is None:
                # Its claims ended (released, failed, or settled by the claim audit) while the allocator still
                # waits for a placement: there is none to give, and silence would leave it waiting for good.
                log.warning("already_placed_and_released")
                await ctx.outbox.add(
                    "placement.unschedulable",
                    m.PlacementUnschedulable(
                        allocation_id=ev.allocation_id,
                        reason_code="claims_released",
                        reason=f"allocation {alloc_id} was placed once and its claims have since been released",
                        free_gpus=0,
                        requested_gpus=ev.gpu_count,
                    ),
                    aggregate_id=alloc_id,
                    event_id=derived_event_id(ctx.envelope.event_id, "placement-again"),
                )
                return
            await ctx.outbox.add(
                "placement.placed",
                again,
                aggregate_id=alloc_id,
                event_id=derived_event_id(ctx.envelope.event_id, "placement-again"),
            )
            log.info("placement_repeated", node_id=again.node_id, fencing_epoch=again.fencing_epoch)
            return
        result = outcome.placed or outcome.unschedulable
        assert result is not None
        kind = "placement.placed" if outcome.placed else "placement.unschedulable"
        # A placement made again after this database lost its commit answers a re-asked request: a new message.
        await ctx.outbox.add(
            kind, result, aggregate_id=alloc_id, event_id=caused_event_id(alloc_id, "placement", ctx.envelope)
        )
        if outcome.placed:
            p = outcome.placed
            log.info(
                "placed",
                node_id=p.node_id,
                claim_mode=p.claim_mode,
                slots=[s.slot_id for s in p.slots],
                attempts=outcome.attempts,
                skipped_locked=outcome.skipped_locked,
                tier=outcome.extra.get("tier"),
            )
        else:
            u = outcome.unschedulable
            log.info(
                "unschedulable", reason_code=u.reason_code, reason=u.reason, filtered=u.filtered, free_gpus=u.free_gpus
            )

    async def on_parity(self, ctx: HandlerContext) -> None:
        ev: m.NodeParityReported = ctx.payload
        outcome = await evidence.record_parity(ctx.conn, ev, allow_emulated=self.policy.allow_emulated_slots)
        asked = await steering.parity_answered(ctx.conn, ev, outcome)
        log.info(
            "parity_recorded",
            node_id=ev.node_id,
            failures=ev.failures,
            warnings=ev.warnings,
            outcome=outcome,
            ask=asked,
        )

    async def on_topology(self, ctx: HandlerContext) -> None:
        ev: m.NodeTopologyReported = ctx.payload
        outcome = await evidence.record_topology(ctx.conn, ev)
        asked = await steering.topology_answered(ctx.conn, ev, outcome)
        log.info(
            "topology_recorded", node_id=ev.node_id, candidates=len(ev.candidate_slots), outcome=outcome, ask=asked
        )

    async def on_drift(self, ctx: HandlerContext) -> None:
        ev: m.NodeDriftReported = ctx.payload
        counts = await drift.record_drift(ctx.conn, ev, ctx.envelope.event_id)
        log.info("drift_recorded", node_id=ev.node_id, reported=len(ev.drift), **counts)

    async def on_slice_preflight(self, ctx: HandlerContext) -> None:
        ev: m.NodeSlicePreflightReported = ctx.payload
        outcome = await evidence.record_slice_preflight(ctx.conn, ev)
        await steering.preflight_answered(ctx.conn, ev)
        log.info(
            "slice_preflight_recorded",
            system_id=ev.system_id,
            status=ev.status,
            reasons=ev.reasons[:5],
            outcome=outcome,
        )

    async def on_image_cache(self, ctx: HandlerContext) -> None:
        ev: m.ImageNodeCacheChanged = ctx.payload
        outcome = await evidence.record_image_cache(ctx.conn, ev, ctx.envelope.occurred_at)
        log.info(
            "image_cache_recorded",
            node_id=ev.node_id,
            slug=ev.slug,
            status=ev.status,
            schedulable=ev.schedulable,
            outcome=outcome,
        )

    async def on_provisioning(self, ctx: HandlerContext) -> None:
        await _lock_allocation(ctx, ctx.payload.allocation_id)
        await inv.set_slot_status(ctx.conn, ctx.payload.allocation_id, "provisioning", only_from=("reserved",))

    async def on_active(self, ctx: HandlerContext) -> None:
        alloc = ctx.payload.allocation_id
        await _lock_allocation(ctx, alloc)
        if await inv.set_slot_status(ctx.conn, alloc, "active", only_from=("provisioning",)):
            return
        # `provisioning` is published before `active`, but another replica may not have applied it yet:
        # slots still `reserved` wait for it (a releasing that overtook both leaves them alone).
        early = sorted(r["slot_id"] for r in await inv.allocation_slots(ctx.conn, alloc) if r["status"] == "reserved")
        if early:
            raise ArrivedEarly(f"allocation.active for {alloc} before its provisioning: {', '.join(early)} reserved")

    async def on_releasing(self, ctx: HandlerContext) -> None:
        await _lock_allocation(ctx, ctx.payload.allocation_id)
        await inv.set_slot_status(
            ctx.conn, ctx.payload.allocation_id, "releasing", only_from=("reserved", "provisioning", "active")
        )

    async def on_released(self, ctx: HandlerContext) -> None:
        ev: m.AllocationReleased = ctx.payload
        await _lock_allocation(ctx, ev.allocation_id)
        freed = await release_allocation(ctx.conn, ev.allocation_id, ev.cleanup, later=ctx.uow.defer)
        log.info("claims_released", count=freed, wipe_verified=ev.cleanup.verified)

    async def on_failed(self, ctx: HandlerContext) -> None:
        ev: m.AllocationFailed = ctx.payload
        await _lock_allocation(ctx, ev.allocation_id)
        await fail_allocation(
            ctx.conn,
            ev.allocation_id,
            ev.cleanup_required,
            f"{ev.reason_code}: {ev.reason}"[:500],
            wipe_proofs=ev.wipe_proofs,
            later=ctx.uow.defer,
        )


class ArrivedEarly(RuntimeError):
    """A lifecycle event whose predecessor, published before it, has not been applied yet (another replica
    is still on it, or it is being retried). Nothing is changed and the bus redelivers it after a delay."""


class EndedOutOfOrder(RuntimeError):
    """An allocation's end arrived while its slots are in a status that end cannot follow (e.g. `released`
    saying the disk was never written while a slot is `active`). Its claims are kept and the message is
    retried: a reordered `releasing` may still come; one that never does is dead-lettered with this text,
    instead of freeing claims of slots that stay in use."""


def _check_in_order(allocation_id: uuid.UUID, slots: list[asyncpg.Record], target: str, event: str) -> None:
    legal = allowed_from(target) | {target}
    stuck = sorted(f"{r['slot_id']} ({r['status']})" for r in slots if r["status"] not in legal)
    if stuck:
        raise EndedOutOfOrder(
            f"allocation.{event} for {allocation_id} cannot move {', '.join(stuck)} to {target}; claims kept"
        )


async def release_allocation(
    conn: asyncpg.Connection,
    allocation_id: uuid.UUID,
    cleanup: m.CleanupReport,
    *,
    later: Callable[[str], None] | None = None,
) -> int:
    """releasing -> cleanup -> available only with a wipe proof for the slot's disk that this scheduler finds
    to satisfy the site's policy (the allocator's `verified` is the host's account, not a verdict); otherwise
    cleanup_blocked with the reason. Claims are released either way: a blocked slot is kept
    out of service by its status, not by a claim nobody will release. A host released from a baremetal
    allocation leaves baremetal mode for `converting` when it is slice-capable (see domain/host_mode.py).
    `later`: the unit of work's `defer`, which takes the capacity summary's write to the COMMIT."""
    held = await inv.allocation_slots(conn, allocation_id)
    await inv.lock_nodes(conn, [r["node_id"] for r in held])
    slots = [r for r in held if r["slot_id"]]
    _check_in_order(allocation_id, slots, "available" if not cleanup.required else "cleanup", "released")
    if slots and not cleanup.required:
        # Released before provisioning, the allocator says: no task ever went to the host. This log of the
        # claim is the scheduler's own evidence of that, and a slot it shows provisioned waits for a wipe.
        sent = await inv.slots_reached(conn, allocation_id, [r["slot_id"] for r in slots], ("provisioning",))
        await _return_untouched(
            conn, allocation_id, slots, sent, {"cleanup": "not required", "reason": cleanup.reason}, "provisioning"
        )
    elif slots:
        proofs = [p.model_dump(mode="json") for p in cleanup.wipe_proofs]
        await inv.move_slots(
            conn,
            [r["slot_id"] for r in slots],
            "cleanup",
            "verifying wipe proof",
            actor="scheduler",
            allocation_id=allocation_id,
            detail={"wipe_proofs": proofs},
        )
        for r in slots:
            problem = wipe_verdict(r, proofs)
            if problem is None:
                await inv.move_slots(
                    conn,
                    [r["slot_id"]],
                    "available",
                    None,
                    actor="scheduler",
                    only_from=("cleanup",),
                    allocation_id=allocation_id,
                    detail={"wipe_verified": r["nvme_by_id"]},
                    health=("healthy", f"wipe verified for {r['nvme_by_id']}"),
                )
            else:
                # Tenant data may remain: out of service until an operator repairs it.
                await _block(conn, allocation_id, [r["slot_id"]], problem, {"wipe_proofs": proofs})
    freed = await inv.release_claims(conn, allocation_id)
    for node_id in sorted({r["node_id"] for r in held if r["claim_kind"] == "node_exclusive"}):
        await host_modes.return_from_baremetal(conn, node_id, allocation_id)
    await inv.refresh_nodes(conn, [r["node_id"] for r in held], later=later)
    return len(freed)


async def fail_allocation(
    conn: asyncpg.Connection,
    allocation_id: uuid.UUID,
    cleanup_required: bool,
    reason: str,
    *,
    wipe_proofs: Sequence[m.WipeProof] = (),
    later: Callable[[str], None] | None = None,
) -> None:
    """A failed attempt's slots: back to available when it provably never wrote them, or when the host's wipe
    proofs (a provision a restart interrupted) satisfy the site's policy for every one of them; otherwise
    cleanup_blocked, and a node held whole is drained."""
    held = await inv.allocation_slots(conn, allocation_id)
    await inv.lock_nodes(conn, [r["node_id"] for r in held])
    slots = [r for r in held if r["slot_id"]]
    slot_ids = [r["slot_id"] for r in slots]
    _check_in_order(allocation_id, slots, "cleanup_blocked" if cleanup_required else "available", "failed")
    proofs = [p.model_dump(mode="json") for p in wipe_proofs]
    if not cleanup_required:
        # The host's word that no disk write began (its task record, written before the clone). A slot this
        # scheduler saw active held a running tenant VM, which no such word can undo.
        ran = await inv.slots_reached(conn, allocation_id, slot_ids, ("active",))
        await _return_untouched(conn, allocation_id, slots, ran, {"failed_without_disk_writes": reason}, "active")
    elif slots and proofs:
        problems = {r["slot_id"]: wipe_verdict(r, proofs) for r in slots}
        await inv.move_slots(
            conn,
            slot_ids,
            "cleanup",
            "verifying wipe proof",
            actor="scheduler",
            allocation_id=allocation_id,
            detail={"failed": reason, "wipe_proofs": proofs},
        )
        if not any(problems.values()):
            for r in slots:
                await inv.move_slots(
                    conn,
                    [r["slot_id"]],
                    "available",
                    None,
                    actor="scheduler",
                    only_from=("cleanup",),
                    allocation_id=allocation_id,
                    detail={"failed": reason, "wipe_verified": r["nvme_by_id"]},
                    health=("healthy", f"wipe verified for {r['nvme_by_id']}"),
                )
        else:
            # All or none: the host keeps its leases on every disk of the task until all are proven wiped, so a
            # slot freed alone would be refused by it at the next provision.
            for slot_id, problem in problems.items():
                why = problem or "another disk of the failed attempt is not proven wiped"
                await _block(conn, allocation_id, [slot_id], f"{reason}; {why}", {"wipe_proofs": proofs})
    else:
        # The attempt touched the disk (clone, boot) and nobody proved a wipe: never straight back to available.
        await _block(conn, allocation_id, slot_ids, reason, None)
    if cleanup_required:
        for r in held:
            if r["claim_kind"] == "node_exclusive":
                await inv.drain_node(conn, r["node_id"], f"cleanup required after {reason}"[:500], actor="scheduler")
    await inv.release_claims(conn, allocation_id)
    await inv.refresh_nodes(conn, [r["node_id"] for r in held], later=later)


async def _return_untouched(
    conn: asyncpg.Connection,
    allocation_id: uuid.UUID,
    slots: list[asyncpg.Record],
    contradicted: set[str],
    detail: dict,
    reached: str,
) -> None:
    """Slots reported never written: back to available, unless the claim's log shows them `reached`."""
    clean = [r["slot_id"] for r in slots if r["slot_id"] not in contradicted]
    await inv.move_slots(conn, clean, "available", None, actor="scheduler", allocation_id=allocation_id, detail=detail)
    for slot_id in sorted(contradicted):
        problem = f"reported never written, but the slot was {reached} under allocation {allocation_id}"
        await _block(conn, allocation_id, [slot_id], problem, detail)


async def _block(
    conn: asyncpg.Connection, allocation_id: uuid.UUID, slot_ids: list[str], problem: str, detail: dict | None
) -> None:
    # Runbook: a failed cleanup marks the slot failed.
    await inv.move_slots(
        conn,
        slot_ids,
        "cleanup_blocked",
        problem[:500],
        actor="scheduler",
        allocation_id=allocation_id,
        detail=detail,
        health=("failed", problem[:500]),
    )


# Evidence consumers, one durable per filter subject (see gpuaas_common.jetstream.CONSUMERS).
EVIDENCE_CONSUMERS = {
    "scheduler-node-parity": "node.parity_reported",
    "scheduler-node-topology": "node.topology_reported",
    "scheduler-image-cache": "image.node_cache_changed",
    "scheduler-slice-preflight": "node.slice_preflight_reported",
    "scheduler-node-drift": "node.drift_reported",
}


def evidence_handlers(scheduler: Scheduler) -> dict[str, dict]:
    """Per evidence consumer, its handler map."""
    by_type = {
        "node.parity_reported": scheduler.on_parity,
        "node.topology_reported": scheduler.on_topology,
        "image.node_cache_changed": scheduler.on_image_cache,
        "node.slice_preflight_reported": scheduler.on_slice_preflight,
        "node.drift_reported": scheduler.on_drift,
    }
    return {durable: {type_: by_type[type_]} for durable, type_ in EVIDENCE_CONSUMERS.items()}


def handlers(scheduler: Scheduler) -> dict:
    return {
        "allocation.accepted": scheduler.on_accepted,
        "allocation.provisioning": scheduler.on_provisioning,
        "allocation.active": scheduler.on_active,
        "allocation.releasing": scheduler.on_releasing,
        "allocation.released": scheduler.on_released,
        "allocation.failed": scheduler.on_failed,
    }
