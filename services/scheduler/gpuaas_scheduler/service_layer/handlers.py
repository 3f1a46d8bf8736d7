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
from collections.abc import Sequence

import asyncpg

from gpuaas_common.bus import HandlerContext
from gpuaas_common.contract import caused_event_id, derived_event_id
from gpuaas_common.contract import messages as m
from gpuaas_common.logging import get_logger
from gpuaas_common.outbox import EventCollector, OutboxWriter

from ..adapters import inventory as inv
from ..adapters.repository import SchedulerRepositories, scheduler_repositories
from ..domain.node_claims import ACTOR, NodeClaims
from ..domain.node_claims import EndedOutOfOrder as EndedOutOfOrder  # raised by NodeClaims; the bus retries it
from . import drift, evidence, host_modes, slot_announcements, slot_wipe, steering
from .host_walk import HostWalker, WalkPolicy
from .placement import PlacementPolicy, place

log = get_logger(__name__)


def mirrored(payload: object) -> bool:
    """Whether a lifecycle message is the scheduler's business (the bus's `wanted`): a baremetal allocation's
    `provisioning` and `active` are not, its node claim has no slot to move. Acknowledged unread, with no unit
    of work, where they cost a transaction each that changed nothing."""
    mirror_only = isinstance(payload, (m.AllocationProvisioning, m.AllocationActive))
    return not (mirror_only and getattr(payload, "shape", None) == "baremetal")


def allocation_first_lock(payload: object) -> str | None:
    """The lock every handler of the lifecycle consumer takes first, for the bus to take with the BEGIN."""
    allocation_id = getattr(payload, "allocation_id", None)
    return inv.allocation_lock_key(allocation_id) if allocation_id is not None else None


async def _lock_allocation(ctx: HandlerContext, allocation_id: uuid.UUID) -> SchedulerRepositories:
    """The allocation's lock (unless the bus took it with the BEGIN), and the repositories to go on with: the unit
    of work's (`scheduler_repositories`, as the service's bus builds them), or, for one built without them (a
    caller passing `no_repositories`), the same repositories on its connection."""
    repos: SchedulerRepositories | None = ctx.uow.repos
    if repos is None:
        repos = scheduler_repositories(ctx.conn)
    if not ctx.uow.holds_lock(inv.allocation_lock_key(allocation_id)):
        await repos.claims.lock_allocation(allocation_id)
    return repos


class Scheduler:
    def __init__(
        self, policy: PlacementPolicy | None = None, walker: HostWalker | None = None, *, drift_reports_kept: int = 1000
    ) -> None:
        self.policy = policy or PlacementPolicy()
        # Each host's drift reports kept at most (the newest), held as each one is written: the hourly sweep
        # alone let a host at its budget grow the table for an hour.
        self.drift_reports_kept = drift_reports_kept
        self.walker = walker or HostWalker(WalkPolicy(allow_emulated=self.policy.allow_emulated_slots))

    async def on_accepted(self, ctx: HandlerContext) -> None:
        ev: m.AllocationAccepted = ctx.payload
        alloc_id = str(ev.allocation_id)
        # A placement asked again (re-drive) while another replica places the first request: without the
        # lock both see no claim and both place.
        repos = await _lock_allocation(ctx, ev.allocation_id)
        outcome = await place(repos.conn, ev, self.policy)
        if outcome.already_placed:
            # A repeated request: the allocator lost track of our answer and asks again. Answer with the claim
            # held, under an id of this request's own (the first answer's id would be dropped as a duplicate).
            again = await repos.claims.held_placement(ev.allocation_id)
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
        # The unit of work's repositories; a bus built without them gets the same on its connection.
        repos = ctx.uow.repos or scheduler_repositories(ctx.conn)
        outcome = await evidence.record_parity(repos, ev, allow_emulated=self.policy.allow_emulated_slots)
        asked = await steering.parity_answered(repos.asks, ev, outcome)
        await self.walker.on_parity(ctx, ev, outcome)
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
        repos = ctx.uow.repos or scheduler_repositories(ctx.conn)
        outcome = await evidence.record_topology(repos, ev)
        asked = await steering.topology_answered(repos.asks, ev, outcome)
        await self.walker.on_topology(ctx, ev, outcome)
        log.info(
            "topology_recorded", node_id=ev.node_id, candidates=len(ev.candidate_slots), outcome=outcome, ask=asked
        )

    async def on_drift(self, ctx: HandlerContext) -> None:
        ev: m.NodeDriftReported = ctx.payload
        repos = ctx.uow.repos or scheduler_repositories(ctx.conn)
        counts = await drift.record_drift(repos, ev, ctx.envelope.event_id, keep=self.drift_reports_kept)
        log.info("drift_recorded", node_id=ev.node_id, reported=len(ev.drift), **counts)

    async def on_slot_wipe(self, ctx: HandlerContext) -> None:
        """A host's wipe proofs (service_layer/slot_wipe.py): taken from its own report subject only."""
        repos = ctx.uow.repos or scheduler_repositories(ctx.conn)
        await slot_wipe.wipe_reported(repos, ctx.outbox, ctx.subject, ctx.payload)

    async def on_slice_preflight(self, ctx: HandlerContext) -> None:
        ev: m.NodeSlicePreflightReported = ctx.payload
        repos = ctx.uow.repos or scheduler_repositories(ctx.conn)
        outcome = await evidence.record_slice_preflight(repos, ev)
        await steering.preflight_answered(repos.asks, ev)
        log.info(
            "slice_preflight_recorded",
            system_id=ev.system_id,
            status=ev.status,
            reasons=ev.reasons[:5],
            outcome=outcome,
        )

    async def on_image_cache(self, ctx: HandlerContext) -> None:
        ev: m.ImageNodeCacheChanged = ctx.payload
        repos = ctx.uow.repos or scheduler_repositories(ctx.conn)
        outcome = await evidence.record_image_cache(repos, ev, ctx.envelope.occurred_at)
        log.info(
            "image_cache_recorded",
            node_id=ev.node_id,
            slug=ev.slug,
            status=ev.status,
            schedulable=ev.schedulable,
            outcome=outcome,
        )

    # --- the lifecycle mirror: the slots follow the allocation ------------------------------------------
    # Only the two moves a later rule reads: `provisioning` (a release that says no disk was written is checked
    # against it) and `active` (so is a failure's). A slice's `releasing` decides nothing and is not followed
    # (contract/catalog.py SCHEDULER_FOLLOWS); a baremetal claim holds no slot to move (`mirrored`).

    async def on_provisioning(self, ctx: HandlerContext) -> None:
        repos = await _lock_allocation(ctx, ctx.payload.allocation_id)
        await repos.slots.move_for_allocation(ctx.payload.allocation_id, "provisioning", ("reserved",))

    async def on_active(self, ctx: HandlerContext) -> None:
        alloc = ctx.payload.allocation_id
        repos = await _lock_allocation(ctx, alloc)
        if await repos.slots.move_for_allocation(alloc, "active", ("provisioning",)):
            return
        # `provisioning` is published before `active`, but another replica may not have applied it yet:
        # slots still `reserved` wait for it (an end that overtook both leaves them alone).
        early = sorted(slot for slot, status in (await repos.slots.statuses(alloc)).items() if status == "reserved")
        if early:
            raise ArrivedEarly(f"allocation.active for {alloc} before its provisioning: {', '.join(early)} reserved")

    async def on_released(self, ctx: HandlerContext) -> None:
        ev: m.AllocationReleased = ctx.payload
        repos = await _lock_allocation(ctx, ev.allocation_id)
        freed = await end_allocation(
            repos,
            ev.allocation_id,
            "released",
            cleanup_required=ev.cleanup.required,
            reason=ev.cleanup.reason,
            wipe_proofs=ev.cleanup.wipe_proofs,
            events=ctx.outbox,
        )
        log.info("claims_released", count=freed, wipe_verified=ev.cleanup.verified)

    async def on_failed(self, ctx: HandlerContext) -> None:
        ev: m.AllocationFailed = ctx.payload
        repos = await _lock_allocation(ctx, ev.allocation_id)
        await end_allocation(
            repos,
            ev.allocation_id,
            "failed",
            cleanup_required=ev.cleanup_required,
            reason=f"{ev.reason_code}: {ev.reason}"[:500],
            wipe_proofs=ev.wipe_proofs,
            events=ctx.outbox,
        )


class ArrivedEarly(RuntimeError):
    """A lifecycle event whose predecessor, published before it, has not been applied yet (another replica
    is still on it, or it is being retried). Nothing is changed and the bus redelivers it after a delay."""


async def end_allocation(
    repos: SchedulerRepositories,
    allocation_id: uuid.UUID,
    event: str,
    *,
    cleanup_required: bool,
    reason: str | None,
    wipe_proofs: Sequence[m.WipeProof],
    events: EventCollector | OutboxWriter,
) -> int:
    """`allocation.released` or `allocation.failed`: load the allocation's `NodeClaims`, one method decides every
    slot (domain/node_claims.py), save; then a host released whole leaves baremetal mode and the capacity summary
    is recomputed. A host where the end left a slot `cleanup_blocked` has its slots announced (`events`); one
    whose slots all went back healthy does not. The number of claims ended."""
    claims = await repos.claims.load(allocation_id, log_reached=NodeClaims.log_to_check(event, cleanup_required))
    proofs = [p.model_dump(mode="json") for p in wipe_proofs]
    if event == "released":
        claims.release(cleanup_required=cleanup_required, reason=reason, proofs=proofs)
    else:
        claims.fail(cleanup_required=cleanup_required, reason=reason or event, proofs=proofs)
    freed = await repos.claims.save(claims)
    if event == "released":
        for node_id in claims.whole_nodes:
            await host_modes.return_from_baremetal(repos.hosts, node_id, allocation_id)
    await repos.nodes.refresh(claims.node_ids)
    cause: m.SlotsChangeCause = "release" if event == "released" else "failure"
    for node_id in claims.blocking_nodes:
        await slot_announcements.announce(events, await repos.slots.announcement(node_id, cause, ACTOR))
    return freed


def _outbox(conn: asyncpg.Connection) -> OutboxWriter:
    """The scheduler's outbox in the caller's transaction, for an end applied outside a unit of work."""
    return OutboxWriter(conn, "scheduler", "scheduler")


async def release_allocation(
    conn: asyncpg.Connection,
    allocation_id: uuid.UUID,
    cleanup: m.CleanupReport,
) -> int:
    """`allocation.released` in the caller's transaction: slots back to available only as `NodeClaims.release`
    decides (a wipe proof this scheduler finds to satisfy the site's policy, or a log that agrees nothing was
    written), claims released either way; a host released whole leaves baremetal mode (domain/host_mode.py)."""
    return await end_allocation(
        scheduler_repositories(conn),
        allocation_id,
        "released",
        cleanup_required=cleanup.required,
        reason=cleanup.reason,
        wipe_proofs=cleanup.wipe_proofs,
        events=_outbox(conn),
    )


async def fail_allocation(
    conn: asyncpg.Connection,
    allocation_id: uuid.UUID,
    cleanup_required: bool,
    reason: str,
    *,
    wipe_proofs: Sequence[m.WipeProof] = (),
) -> None:
    """`allocation.failed` in the caller's transaction, `reason` as the slots will show it: see `NodeClaims.fail`."""
    await end_allocation(
        scheduler_repositories(conn),
        allocation_id,
        "failed",
        cleanup_required=cleanup_required,
        reason=reason,
        wipe_proofs=wipe_proofs,
        events=_outbox(conn),
    )


# Evidence consumers, one durable per filter subject (see gpuaas_common.jetstream.CONSUMERS).
EVIDENCE_CONSUMERS = {
    "scheduler-node-parity": "node.parity_reported",
    "scheduler-node-topology": "node.topology_reported",
    "scheduler-image-cache": "image.node_cache_changed",
    "scheduler-slice-preflight": "node.slice_preflight_reported",
    "scheduler-node-drift": "node.drift_reported",
    "scheduler-node-slot-wipes": "node.slot_wipe_reported",
}


def evidence_handlers(scheduler: Scheduler) -> dict[str, dict]:
    """Per evidence consumer, its handler map."""
    by_type = {
        "node.parity_reported": scheduler.on_parity,
        "node.topology_reported": scheduler.on_topology,
        "image.node_cache_changed": scheduler.on_image_cache,
        "node.slice_preflight_reported": scheduler.on_slice_preflight,
        "node.drift_reported": scheduler.on_drift,
        "node.slot_wipe_reported": scheduler.on_slot_wipe,
    }
    return {durable: {type_: by_type[type_]} for durable, type_ in EVIDENCE_CONSUMERS.items()}


def handlers(scheduler: Scheduler) -> dict:
    return {
        "allocation.accepted": scheduler.on_accepted,
        "allocation.provisioning": scheduler.on_provisioning,
        "allocation.active": scheduler.on_active,
        "allocation.released": scheduler.on_released,
        "allocation.failed": scheduler.on_failed,
    }
