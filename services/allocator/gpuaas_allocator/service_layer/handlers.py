"""The allocator as process manager: one message in, one transaction, the next command out.

Every handler locks the allocation row first, so messages about one allocation that arrive on
different consumers are serialised by Postgres, not by luck. State changes go through
`lifecycle.transition` (and `lifecycle.fail`); the tasks and MAAS commands sent out are built in `commands`.
"""

from __future__ import annotations

from typing import Any

from gpuaas_common.bus import HandlerContext, PermanentError
from gpuaas_common.contract import derived_event_id
from gpuaas_common.contract import messages as m
from gpuaas_common.enrolment import enrolment_proof
from gpuaas_common.logging import get_logger

from ..domain.model import ActiveImage, release_refusal, request_fingerprint, validate_request
from ..settings import AllocatorSettings
from .commands import provision_task_id, release_task_id, start_provisioning, start_teardown
from .failed_machines import record_after_failure, release_failed_machine
from .late_vms import late_vm_left_running, record_late_result, record_late_vm_teardown
from .lifecycle import fail, transition
from .redrive import EARLY_RESULT_MISMATCH, hold_early_result

log = get_logger(__name__)

FORCE_RELEASED = "force_released"
RELEASE_COMMIT_LOST = "release_commit_lost"


class PlacementNotSeenYet(Exception):
    """Transient: the bus redelivers the message later."""


class Allocator:
    def __init__(self, settings: AllocatorSettings) -> None:
        self.settings = settings

    # --- portal input ----------------------------------------------------------------------------

    async def on_requested(self, ctx: HandlerContext) -> None:
        req: m.AllocationRequested = ctx.payload
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
        await ctx.uow.repos.insert(
            allocation_id=req.allocation_id,
            tenant_id=req.tenant_id,
            shape=req.shape,
            sku=req.sku,
            gpu_count=req.gpu_count,
            region=req.region,
            image_slug=image.slug,
            image_digest=image.digest_sha256,
            image_path=image.image_path,
            request_hash=fingerprint,
            request=req.model_dump(mode="json"),
            state="requested",
        )
        await ctx.uow.repos.append_timeline(req.allocation_id, "requested", None, cause_event_id=ctx.envelope.event_id)
        row = {"allocation_id": req.allocation_id, "tenant_id": req.tenant_id, "shape": req.shape, "state": "requested"}
        await transition(
            ctx,
            row,
            "accepted",
            sku=req.sku,
            gpu_count=req.gpu_count,
            region=req.region,
            image=m.ImageRef(slug=image.slug, digest_sha256=image.digest_sha256, image_path=image.image_path),
        )

    async def _reject(self, ctx: HandlerContext, req: m.AllocationRequested, code: str, reason: str) -> None:
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

    async def on_release_requested(self, ctx: HandlerContext) -> None:
        req: m.AllocationReleaseRequested = ctx.payload
        row = await ctx.uow.repos.lock(req.allocation_id)
        state = row["state"] if row is not None else None
        refusal = release_refusal(state)
        if refusal is not None:
            # Answered on the bus, so the asker learns at once instead of waiting for a release that never comes.
            log.info("release_rejected", state=state, reason_code=refusal.reason_code)
            await ctx.outbox.add(
                "allocation.release_rejected",
                m.AllocationReleaseRejected(
                    allocation_id=req.allocation_id,
                    tenant_id=row["tenant_id"] if row else None,
                    shape=row["shape"] if row else None,
                    state=state,
                    reason_code=refusal.reason_code,
                    reason=refusal.reason,
                ),
                aggregate_id=str(req.allocation_id),
                event_id=derived_event_id(ctx.envelope.event_id, "release_rejected"),
            )
            return
        assert row is not None
        row = await transition(ctx, row, "releasing", reason=req.reason)
        # A command already in flight (placement, provisioning) finishes first; its result handler
        # then starts the teardown. Only an allocation at rest is torn down right away.
        if state == "active":
            await start_teardown(self.settings, ctx, row)

    # --- placement --------------------------------------------------------------------------------

    async def on_placed(self, ctx: HandlerContext) -> None:
        ev: m.PlacementPlaced = ctx.payload
        row = await ctx.uow.repos.lock(ev.allocation_id)
        if row is None or row["state"] not in ("accepted", "releasing") or row["node_id"] is not None:
            log.warning("placement_unexpected", state=row["state"] if row else None)
            return
        placement = ev.model_dump(mode="json")
        update = {"node_id": ev.node_id, "maas_system_id": ev.maas_system_id, "placement": placement}
        early = await self._take_early_result(ctx, row, ev.node_id)
        if row["state"] == "releasing" and early is not None:
            # Released while its record was lost, but the host did build it: tear the VM down like any other.
            await ctx.uow.repos.update(ev.allocation_id, **update, task_id=early.task_id)
            await start_teardown(self.settings, ctx, {**row, **update, "task_id": early.task_id})
            return
        if row["state"] == "releasing":
            # Released before anything was built: nothing was touched, the claim can go at once.
            await ctx.uow.repos.update(ev.allocation_id, **update)
            await transition(
                ctx,
                row,
                "released",
                node_id=ev.node_id,
                cleanup=m.CleanupReport(required=False, verified=True, reason="released before provisioning"),
            )
            return
        row = await transition(
            ctx,
            row,
            "placed",
            update=update,
            node_id=ev.node_id,
            claim_mode=ev.claim_mode,
            slots=ev.slots,
            maas_system_id=ev.maas_system_id,
        )
        await start_provisioning(self.settings, ctx, row, ev)
        if early is not None:
            # The result came before this placement was (again) applied: the task is known now, so apply it.
            row = await ctx.uow.repos.lock(ev.allocation_id)
            log.warning("early_task_result_applied", task_id=early.task_id, status=early.status)
            await self._on_provision_result(ctx, dict(row), early)

    async def _take_early_result(
        self, ctx: HandlerContext, row: dict[str, Any], node_id: str
    ) -> m.NodeTaskResult | None:
        """The kept result of this allocation's provision task (see redrive.py), if it came from the placed node.
        One from another node describes a VM no claim explains any more: recorded, not applied."""
        task_id = provision_task_id(self.settings, row["allocation_id"])
        kept = await ctx.uow.repos.take_early_result(row["allocation_id"], task_id)
        if kept is None:
            return None
        res = m.NodeTaskResult.model_validate(kept["result"])
        if kept["node_id"] == node_id:
            return res
        log.warning(EARLY_RESULT_MISMATCH, task_id=res.task_id, result_node_id=kept["node_id"], placed_node_id=node_id)
        await ctx.uow.repos.append_timeline(
            row["allocation_id"],
            row["state"],
            row["state"],
            reason_code=EARLY_RESULT_MISMATCH,
            detail={"task_id": res.task_id, "result_node_id": kept["node_id"], "placed_node_id": node_id},
            cause_event_id=ctx.envelope.event_id,
        )
        return None

    async def on_unschedulable(self, ctx: HandlerContext) -> None:
        ev: m.PlacementUnschedulable = ctx.payload
        row = await ctx.uow.repos.lock(ev.allocation_id)
        if row is None or row["state"] not in ("accepted", "releasing"):
            return
        if row["state"] == "releasing":
            await transition(
                ctx, row, "released", cleanup=m.CleanupReport(required=False, verified=True, reason="never placed")
            )
            return
        await transition(
            ctx,
            row,
            "unschedulable",
            reason_code=ev.reason_code,
            update={"failure_code": ev.reason_code, "failure_reason": ev.reason},
            detail={"filtered": ev.filtered, "free_gpus": ev.free_gpus},
            reason=ev.reason,
            filtered=ev.filtered,
            free_gpus=ev.free_gpus,
            requested_gpus=ev.requested_gpus,
        )

    async def on_force_released(self, ctx: HandlerContext) -> None:
        """An operator freed the claims in the scheduler: the allocation ends as failed with cleanup required
        (its slots wait in cleanup_blocked). A task still out is given up like one past its deadline, so its
        answer is recorded on the timeline and changes nothing."""
        ev: m.PlacementForceReleased = ctx.payload
        row = await ctx.uow.repos.lock(ev.allocation_id)
        if row is None or row["state"] in ("released", "failed", "unschedulable"):
            log.info("force_release_noop", state=row["state"] if row else None)
            return
        if row["state"] == "accepted":
            # The scheduler held claims, so its placement is on the way (the same stream, behind this one only
            # after a redelivery): retried until it has been applied, never failed from a state that forbids it.
            raise PlacementNotSeenYet(f"allocation {ev.allocation_id} force-released before its placement arrived")
        outstanding = (row["release_task_id"] or row["task_id"]) if row["awaiting_result"] else None
        if outstanding is not None:
            await ctx.uow.repos.update(ev.allocation_id, awaiting_result=False, timed_out_task_id=outstanding)
        await fail(
            ctx,
            dict(row),
            FORCE_RELEASED,
            f"force-released by {ev.actor}: {ev.reason}",
            row["node_id"],
            cleanup_required=True,
            detail={"forced": ev.forced, "holders": ev.holders, "slots": ev.slot_ids, "abandoned_task": outstanding},
        )
        await release_failed_machine(self.settings, ctx, dict(row))

    # --- results from node agents and MAAS ----------------------------------------------------------

    async def on_task_result(self, ctx: HandlerContext) -> None:
        res: m.NodeTaskResult = ctx.payload
        row = await ctx.uow.repos.lock(res.allocation_id)
        if (
            row is not None
            and row["task_id"] is None
            and row["state"] in ("accepted", "releasing")
            and res.task_id == provision_task_id(self.settings, res.allocation_id)
        ):
            # The provision task this allocation would be sent, but it is not placed: the commits that placed it
            # were lost after the task went out. Keep the result and re-ask the placement (redrive.py).
            await hold_early_result(ctx, dict(row), res)
            return
        if (
            row is not None
            and row["state"] == "active"
            and row["release_task_id"] is None
            and res.task_id == release_task_id(self.settings, res.allocation_id)
            and res.node_id == row["node_id"]
        ):
            # The teardown of this very allocation, answered by its own host, while the allocation is still
            # active: the commit that started the release was lost after its task went out (a database that
            # acknowledged commits it then lost; a chaos run found it). The VM is gone, so the allocation cannot
            # stay active: take the release as asked and apply its answer.
            log.warning("release_commit_lost", task_id=res.task_id, node_id=res.node_id, status=res.status)
            row = await transition(
                ctx,
                dict(row),
                "releasing",
                reason_code=RELEASE_COMMIT_LOST,
                update={"release_task_id": res.task_id, "awaiting_result": True},
                reason="the host answered a teardown whose start this allocator had lost",
            )
            await self._on_release_result(ctx, row, res)
            return
        # A host can only report as itself (the bus enforces the subject), but it can still claim a
        # task it was never sent or another host's allocation: both change nothing and are dead-lettered.
        if row is None or res.task_id not in {row["task_id"], row["release_task_id"]} - {None}:
            raise PermanentError("unknown_task", f"no task {res.task_id} was sent for allocation {res.allocation_id}")
        if row["node_id"] is not None and res.node_id != row["node_id"]:
            raise PermanentError(
                "node_mismatch", f"task {res.task_id} went to {row['node_id']}, result came from {res.node_id}"
            )
        if row.get("timed_out_task_id") == res.task_id:
            # A task we did send, but gave up on at its deadline: the allocation has already failed and its
            # slots wait for cleanup. Record the answer for ops; apply nothing; do not dead-letter it.
            await record_late_result(ctx, row, res)
            if late_vm_left_running(row, res):
                # ...except that the VM it built runs for no allocation, on slots ops may already have freed
                # (a forced release): tear it down like any release, and keep its answer (below).
                log.warning("late_vm_teardown_started", task_id=res.task_id, node_id=res.node_id)
                await start_teardown(self.settings, ctx, dict(row))
            return
        if res.task_id == row["task_id"] and row["awaiting_result"] and row["release_task_id"] is None:
            await self._on_provision_result(ctx, dict(row), res)
        elif res.task_id == row["release_task_id"] and row["state"] == "releasing":
            await self._on_release_result(ctx, dict(row), res)
        elif res.task_id == row["release_task_id"] and row["state"] == "failed" and row["awaiting_result"]:
            await record_late_vm_teardown(ctx, dict(row), res)
        else:
            log.info("task_result_ignored", state=row["state"])

    async def _on_provision_result(self, ctx: HandlerContext, row: dict[str, Any], res: m.NodeTaskResult) -> None:
        if res.status == "succeeded" and row["state"] != "releasing":
            ready = res.readiness
            access = m.AccessInfo(
                ip=ready.actual_ip if ready else None,
                mac=ready.mac if ready else None,
                ssh_ready=ready.ssh_ready if ready else None,
                port=ready.ssh_port if ready else None,
                user=ready.ssh_user if ready else None,
                host_key_fingerprint=ready.host_key_fingerprint if ready else None,
            )
            # The common case in one statement: no longer awaiting a result, and active.
            await transition(
                ctx,
                row,
                "active",
                update={"awaiting_result": False, "access": access.model_dump(mode="json")},
                node_id=res.node_id,
                access=access,
                detail={"readiness": res.readiness.model_dump(mode="json") if res.readiness else None},
            )
            return
        await ctx.uow.repos.update(row["allocation_id"], awaiting_result=False)
        if res.status == "succeeded":  # built while a release waited: tear it down now
            await start_teardown(self.settings, ctx, row)
            return
        await fail(
            ctx,
            row,
            res.reason_code or "provisioning_failed",
            res.reason,
            res.node_id,
            cleanup_required=res.disk_touched,
            wipe_proofs=list(res.wipe_proofs),
        )

    async def _on_release_result(self, ctx: HandlerContext, row: dict[str, Any], res: m.NodeTaskResult) -> None:
        if res.status == "succeeded":
            # `verified` summarises the host's own account for the portal; the scheduler judges each disk's proof.
            verified = bool(res.wipe_proofs) and all(p.verified for p in res.wipe_proofs)
            cleanup = m.CleanupReport(
                required=True,
                verified=verified,
                wipe_proofs=res.wipe_proofs,
                reason=None if verified else "wipe not verified",
            )
            await transition(
                ctx, row, "released", update={"awaiting_result": False}, node_id=res.node_id, cleanup=cleanup
            )
            return
        await ctx.uow.repos.update(row["allocation_id"], awaiting_result=False)
        await fail(
            ctx, row, res.reason_code or "release_failed", res.reason, res.node_id, wipe_proofs=list(res.wipe_proofs)
        )

    async def on_enrolled(self, ctx: HandlerContext) -> None:
        ev: m.NodeEnrolled = ctx.payload
        if ev.kind != "baremetal" or ev.allocation_id is None:
            return
        row = await ctx.uow.repos.lock(ev.allocation_id)
        if row is None or row["shape"] != "baremetal" or row["maas_system_id"] != ev.maas_system_id:
            log.warning("enrolment_unmatched")
            return
        expected = enrolment_proof(
            self.settings.enrolment_secret.get_secret_value(), str(ev.allocation_id), row["maas_system_id"]
        )
        if ev.enrolment_proof != expected:
            log.warning("enrolment_proof_mismatch")
            return
        await ctx.uow.repos.update(row["allocation_id"], enrolled=True)
        row = dict(row)
        row["enrolled"] = True
        await self._maybe_baremetal_active(ctx, row)

    async def _maybe_baremetal_active(self, ctx: HandlerContext, row: dict[str, Any]) -> None:
        if row["state"] == "provisioning" and row["deployed"] and row["enrolled"]:
            access = m.AccessInfo(maas_system_id=row["maas_system_id"])
            await transition(
                ctx,
                row,
                "active",
                update={"access": access.model_dump(mode="json")},
                node_id=row["node_id"],
                access=access,
            )

    async def on_maas_result(self, ctx: HandlerContext) -> None:
        res = ctx.payload
        row = await ctx.uow.repos.lock(res.allocation_id)
        if row is None:
            return
        row = dict(row)
        if row["state"] == "released":
            # A repeat: a release command asked again (its first answer's commit lost, or merely late) is answered
            # again, under a new message id. Stale, acknowledged; before, it was retried until dead-lettered.
            log.info("maas_result_stale", operation_id=res.operation_id, status=res.status, state=row["state"])
            return
        if row["state"] == "failed" and res.operation_id in {row["operation_id"], row["release_operation_id"]}:
            await record_after_failure(ctx, row, res)
            if ctx.envelope.type == "maas.deploy_result" and res.status == "deployed":
                # Deployed after all, after the allocation failed (a forced release while MAAS deployed it).
                await release_failed_machine(self.settings, ctx, row)
            return
        if ctx.envelope.type == "maas.deploy_result" and res.operation_id == row["operation_id"]:
            await ctx.uow.repos.update(row["allocation_id"], awaiting_result=False)
            if res.status == "deployed":
                await ctx.uow.repos.update(row["allocation_id"], deployed=True)
                row["deployed"] = True
                if row["state"] == "releasing":
                    await start_teardown(self.settings, ctx, row)
                    return
                await self._maybe_baremetal_active(ctx, row)
                return
            code = res.reason_code or "deploy_failed"
            reason = res.status_message or f"MAAS reports {res.maas_status_name}"
            await fail(ctx, row, code, reason, row["node_id"])
            # Failed deployment still holds (part of) the tenant's image.
            await release_failed_machine(self.settings, ctx, row)
        elif ctx.envelope.type == "maas.release_result" and res.operation_id == row["release_operation_id"]:
            await ctx.uow.repos.update(row["allocation_id"], awaiting_result=False)
            if res.status == "released":
                cleanup = m.CleanupReport(required=True, verified=True, reason=f"MAAS {res.maas_status_name}")
                await transition(ctx, row, "released", node_id=row["node_id"], cleanup=cleanup)
            else:
                await fail(ctx, row, res.reason_code or "release_failed", res.status_message, row["node_id"])
        else:
            log.info("maas_result_ignored", state=row["state"])

    # --- image catalog -------------------------------------------------------------------------

    # One slug's activation and the deactivation after it may be handled by two replicas at once. The
    # pipeline stamps them under its image row lock, one after the other, so their occurred_at order is
    # theirs (its replicas' clocks agreeing to within the time between the two); the slug's clock row
    # serialises our handlers and turns the older of the two into a stale event, acknowledged unapplied.

    async def on_image_activated(self, ctx: HandlerContext) -> None:
        ev: m.ImageActivated = ctx.payload
        if not await ctx.uow.repos.advance_image_clock(ev.slug, ctx.envelope.occurred_at):
            log.info("stale_image_event_ignored", slug=ev.slug, type=ctx.envelope.type)
            return
        await ctx.uow.repos.upsert_image(ActiveImage(ev.slug, ev.kind, ev.sku, ev.digest_sha256, ev.image_path))

    async def on_image_deactivated(self, ctx: HandlerContext) -> None:
        slug = ctx.payload.slug
        if not await ctx.uow.repos.advance_image_clock(slug, ctx.envelope.occurred_at):
            log.info("stale_image_event_ignored", slug=slug, type=ctx.envelope.type)
            return
        await ctx.uow.repos.delete_image(slug)


def handlers_by_consumer(allocator: Allocator) -> dict[str, dict[str, Any]]:
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
