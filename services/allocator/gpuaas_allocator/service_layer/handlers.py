"""The allocator as process manager: one message in, one transaction, the next command out.

Each handler loads the allocation (locking its row first, so messages about one allocation that arrive on
different consumers are serialised by Postgres, not by luck), asks it to do one thing, and saves it; the bus
commits. The rules live in the aggregate (domain/allocation.py); what is left here is what needs the
database: the idempotency check of a request, the image catalog, and the early results kept for an
allocation whose placement was lost.
"""

from __future__ import annotations

import uuid
from typing import Any

from gpuaas_common.bus import Handler, PermanentError
from gpuaas_common.contract import derived_event_id
from gpuaas_common.contract import messages as m
from gpuaas_common.logging import get_logger

from ..domain.allocation import (
    FORCE_RELEASED,
    RELEASE_COMMIT_LOST,
    Allocation,
    ForeignResult,
    PlacementNotSeenYet,
    release_rejected,
)
from ..domain.model import ActiveImage, release_refusal, request_fingerprint, validate_request
from ..settings import AllocatorSettings
from .commands import policy_of, save
from .ports import AllocatorContext
from .redrive import hold_early_result

__all__ = ["FORCE_RELEASED", "RELEASE_COMMIT_LOST", "Allocator", "PlacementNotSeenYet", "handlers_by_consumer"]

log = get_logger(__name__)


class Allocator:
    def __init__(self, settings: AllocatorSettings) -> None:
        self.settings = settings
        self.policy = policy_of(settings)

    async def _load(self, ctx: AllocatorContext[Any], allocation_id: uuid.UUID) -> Allocation | None:
        return await ctx.uow.repos.get(allocation_id, self.policy, ctx.envelope)

    # --- portal input ----------------------------------------------------------------------------

    async def on_requested(self, ctx: AllocatorContext[m.AllocationRequested]) -> None:
        req = ctx.payload
        fingerprint = request_fingerprint(req)
        existing = await ctx.uow.repos.lock(req.allocation_id)
        if existing is not None:
            if existing["request_hash"] == fingerprint:
                log.info("request_replay_ignored")
                return
            await self._reject(ctx, req, "idempotency_conflict", "allocation_id already used for a different request")
            return
        image = await ctx.uow.repos.get_image(req.image)
        rejection = validate_request(req, image)
        if rejection is not None:
            await self._reject(ctx, req, rejection.reason_code, rejection.reason)
            return
        assert image is not None
        await save(ctx.uow, Allocation.request_accepted(req, image, fingerprint, self.policy, ctx.envelope))

    async def _reject(self, ctx: AllocatorContext[Any], req: m.AllocationRequested, code: str, reason: str) -> None:
        log.info("request_rejected", reason_code=code, reason=reason)
        await ctx.outbox.add(
            "allocation.rejected",
            m.AllocationRejected(
                allocation_id=req.allocation_id,
                tenant_id=req.tenant_id,
                shape=req.shape,
                reason_code=code,
                reason=reason,
            ),
            aggregate_id=str(req.allocation_id),
            event_id=derived_event_id(ctx.envelope.event_id, "rejected"),
        )

    async def on_release_requested(self, ctx: AllocatorContext[m.AllocationReleaseRequested]) -> None:
        req = ctx.payload
        alloc = await self._load(ctx, req.allocation_id)
        if alloc is None:
            refusal = release_refusal(None)
            assert refusal is not None
            # Answered on the bus, so the asker learns at once instead of waiting for a release that never comes.
            log.info("release_rejected", state=None, reason_code=refusal.reason_code)
            await ctx.outbox.add(
                "allocation.release_rejected",
                release_rejected(req, refusal, None),
                aggregate_id=str(req.allocation_id),
                event_id=derived_event_id(ctx.envelope.event_id, "release_rejected"),
            )
            return
        alloc.release(req)
        await save(ctx.uow, alloc)

    # --- placement --------------------------------------------------------------------------------

    async def on_placed(self, ctx: AllocatorContext[m.PlacementPlaced]) -> None:
        ev = ctx.payload
        alloc = await self._load(ctx, ev.allocation_id)
        if alloc is None or not alloc.awaits_placement:
            log.warning("placement_unexpected", state=alloc.state if alloc else None)
            return
        # Taken (deleted) only by the placement it waited for: it is applied, or judged, once.
        early = await ctx.uow.repos.take_early_result(
            alloc.allocation_id, self.policy.provision_task_id(ev.allocation_id)
        )
        alloc.place(ev, early)
        await save(ctx.uow, alloc)

    async def on_unschedulable(self, ctx: AllocatorContext[m.PlacementUnschedulable]) -> None:
        ev = ctx.payload
        alloc = await self._load(ctx, ev.allocation_id)
        if alloc is None:
            return
        alloc.mark_unschedulable(ev)
        await save(ctx.uow, alloc)

    async def on_force_released(self, ctx: AllocatorContext[m.PlacementForceReleased]) -> None:
        ev = ctx.payload
        alloc = await self._load(ctx, ev.allocation_id)
        if alloc is None:
            log.info("force_release_noop", state=None)
            return
        alloc.force_release(ev)
        await save(ctx.uow, alloc)

    # --- results from node agents and MAAS ----------------------------------------------------------

    async def on_task_result(self, ctx: AllocatorContext[m.NodeTaskResult]) -> None:
        res = ctx.payload
        alloc = await self._load(ctx, res.allocation_id)
        if alloc is not None and alloc.answers_unplaced_provision(res):
            # Kept in the database, not on the allocation: the placement's answer takes it (redrive.py).
            await hold_early_result(ctx.uow, alloc, res, ctx.envelope.event_id)
            return
        if alloc is None:
            raise PermanentError("unknown_task", f"no task {res.task_id} was sent for allocation {res.allocation_id}")
        try:
            alloc.take_task_result(res)
        except ForeignResult as exc:
            raise PermanentError(exc.code, exc.reason) from None
        await save(ctx.uow, alloc)

    async def on_enrolled(self, ctx: AllocatorContext[m.NodeEnrolled]) -> None:
        ev = ctx.payload
        if ev.kind == "slice_host":
            # A tenant's machine offering itself for slices: refused on the timeline of the allocation that
            # holds it (the image pipeline refuses it on its own side); a slice host's enrolment is no
            # business of the allocator's otherwise.
            for row in await ctx.uow.repos.lock_machine_holders(ev.node_id):
                holder = ctx.uow.repos.aggregate(row, self.policy, ctx.envelope)
                holder.refuse_slice_enrolment(ev)
                await save(ctx.uow, holder)
            return
        if ev.allocation_id is None:
            return
        alloc = await self._load(ctx, ev.allocation_id)
        if alloc is None:
            log.warning("enrolment_unmatched")
            return
        alloc.enrol(ev)
        await save(ctx.uow, alloc)

    async def on_maas_result(self, ctx: AllocatorContext[m.MaasDeployResult | m.MaasReleaseResult]) -> None:
        res = ctx.payload
        alloc = await self._load(ctx, res.allocation_id)
        if alloc is None:
            return
        alloc.take_maas_result(res)
        await save(ctx.uow, alloc)

    # --- image catalog -------------------------------------------------------------------------

    # One slug's activation and the deactivation after it may be handled by two replicas at once. The
    # pipeline stamps them under its image row lock, one after the other, so their occurred_at order is
    # theirs (its replicas' clocks agreeing to within the time between the two); the slug's clock row
    # serialises our handlers and turns the older of the two into a stale event, acknowledged unapplied.

    async def on_image_activated(self, ctx: AllocatorContext[m.ImageActivated]) -> None:
        ev = ctx.payload
        if not await ctx.uow.repos.advance_image_clock(ev.slug, ctx.envelope.occurred_at):
            log.info("stale_image_event_ignored", slug=ev.slug, type=ctx.envelope.type)
            return
        await ctx.uow.repos.upsert_image(
            ActiveImage(
                ev.slug, ev.kind, ev.sku, ev.digest_sha256, ev.image_path, ev.driver_strategy, ev.driver_version
            )
        )

    async def on_image_deactivated(self, ctx: AllocatorContext[m.ImageDeactivated]) -> None:
        slug = ctx.payload.slug
        if not await ctx.uow.repos.advance_image_clock(slug, ctx.envelope.occurred_at):
            log.info("stale_image_event_ignored", slug=slug, type=ctx.envelope.type)
            return
        await ctx.uow.repos.delete_image(slug)


def handlers_by_consumer(allocator: Allocator) -> dict[str, dict[str, Handler]]:
    return {
        "allocator-requested": {"allocation.requested": allocator.on_requested},
        "allocator-release-requested": {"allocation.release_requested": allocator.on_release_requested},
        "allocator-placement": {
            "placement.placed": allocator.on_placed,
            "placement.unschedulable": allocator.on_unschedulable,
            "placement.force_released": allocator.on_force_released,
        },
        "allocator-task-results": {"node.task_result": allocator.on_task_result},
        "allocator-enrolments": {"node.enrolled": allocator.on_enrolled},
        "allocator-maas-results": {
            "maas.deploy_result": allocator.on_maas_result,
            "maas.release_result": allocator.on_maas_result,
        },
        "allocator-images": {
            "image.activated": allocator.on_image_activated,
            "image.deactivated": allocator.on_image_deactivated,
        },
    }
