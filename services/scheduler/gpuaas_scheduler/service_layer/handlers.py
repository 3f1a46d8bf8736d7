"""Scheduler handlers: place accepted allocations, follow their lifecycle, free what they held."""

from __future__ import annotations

from gpuaas_common.bus import HandlerContext
from gpuaas_common.contract import derived_event_id
from gpuaas_common.contract import messages as m
from gpuaas_common.logging import get_logger

from ..adapters import inventory as inv
from ..domain.placement import choose_slots, rank_nodes, unschedulable_summary

log = get_logger(__name__)


class Scheduler:
    async def on_accepted(self, ctx: HandlerContext) -> None:
        ev: m.AllocationAccepted = ctx.payload
        assert ctx.conn is not None and ctx.outbox is not None
        existing = await ctx.conn.fetchval(
            "SELECT 1 FROM allocation_resource_claims WHERE allocation_id = $1 LIMIT 1", ev.allocation_id
        )
        if existing:
            log.info("already_placed")
            return
        alloc_id = str(ev.allocation_id)
        placed_id = derived_event_id(alloc_id, "placement")
        if ev.shape == "baremetal":
            node = await inv.claim_baremetal(ctx.conn, ev.region, ev.sku, ev.allocation_id)
            if node is not None:
                await ctx.outbox.add(
                    "placement.placed",
                    m.PlacementPlaced(allocation_id=ev.allocation_id, node_id=node["node_id"],
                                      claim_mode="node_exclusive", fencing_epoch=node["epoch"],
                                      maas_system_id=node["maas_system_id"]),
                    aggregate_id=alloc_id, event_id=placed_id,
                )
                log.info("placed", node_id=node["node_id"], claim_mode="node_exclusive")
                return
            kind, requested = "baremetal", 8
        else:
            for candidate in rank_nodes(await inv.slice_candidates(ctx.conn, ev.region, ev.sku), ev.gpu_count):
                # A savepoint per attempt: a node whose slots were taken meanwhile costs nothing.
                async with ctx.conn.transaction():
                    claimed = await inv.claim_slots(ctx.conn, candidate.node_id, ev.allocation_id, ev.gpu_count,
                                                    choose_slots)
                if claimed is None:
                    continue
                epoch, slots = claimed
                await ctx.outbox.add(
                    "placement.placed",
                    m.PlacementPlaced(
                        allocation_id=ev.allocation_id, node_id=candidate.node_id, claim_mode="slots",
                        fencing_epoch=epoch, slots=[m.SlotBinding(**dict(r)) for r in slots],
                    ),
                    aggregate_id=alloc_id, event_id=placed_id,
                )
                log.info("placed", node_id=candidate.node_id, claim_mode="slots", slots=[r["slot_id"] for r in slots])
                return
            kind, requested = "slice_host", ev.gpu_count
        filtered, free = await inv.filter_counts(ctx.conn, ev.region, ev.sku, kind, requested)
        code, reason = unschedulable_summary(filtered, free, requested)
        await ctx.outbox.add(
            "placement.unschedulable",
            m.PlacementUnschedulable(allocation_id=ev.allocation_id, reason_code=code, reason=reason,
                                     filtered=dict(filtered), free_gpus=free, requested_gpus=requested),
            aggregate_id=alloc_id, event_id=placed_id,
        )
        log.info("unschedulable", reason_code=code, filtered=dict(filtered), free_gpus=free)

    async def on_provisioning(self, ctx: HandlerContext) -> None:
        assert ctx.conn is not None
        await inv.set_slot_status(ctx.conn, ctx.payload.allocation_id, "provisioning", only_from=("reserved",))

    async def on_active(self, ctx: HandlerContext) -> None:
        assert ctx.conn is not None
        await inv.set_slot_status(ctx.conn, ctx.payload.allocation_id, "active", only_from=("provisioning",))

    async def on_releasing(self, ctx: HandlerContext) -> None:
        assert ctx.conn is not None
        await inv.set_slot_status(ctx.conn, ctx.payload.allocation_id, "releasing",
                                  only_from=("reserved", "provisioning", "active"))

    async def on_released(self, ctx: HandlerContext) -> None:
        ev: m.AllocationReleased = ctx.payload
        assert ctx.conn is not None
        cleanup = ev.cleanup
        if cleanup.required and not cleanup.verified:
            # Tenant data may remain: the slot stays out of service until an operator repairs it.
            await inv.set_slot_status(ctx.conn, ev.allocation_id, "cleanup_blocked",
                                      cleanup.reason or "wipe proof missing or failed")
        else:
            await inv.set_slot_status(ctx.conn, ev.allocation_id, "available")
        freed = await inv.release_claims(ctx.conn, ev.allocation_id)
        log.info("claims_released", count=len(freed), wipe_verified=cleanup.verified)

    async def on_failed(self, ctx: HandlerContext) -> None:
        ev: m.AllocationFailed = ctx.payload
        assert ctx.conn is not None
        if ev.cleanup_required:
            await inv.set_slot_status(ctx.conn, ev.allocation_id, "cleanup_blocked", f"{ev.reason_code}: {ev.reason}"[:500])
            exclusive = await ctx.conn.fetch(
                "SELECT node_id FROM allocation_resource_claims WHERE allocation_id = $1 "
                "AND claim_kind = 'node_exclusive' AND status <> 'released'", ev.allocation_id,
            )
            for row in exclusive:
                await ctx.conn.execute(
                    "UPDATE nodes SET draining = true, drain_reason = $2, updated_at = now() WHERE node_id = $1",
                    row["node_id"], f"cleanup required after {ev.reason_code}",
                )
        else:
            await inv.set_slot_status(ctx.conn, ev.allocation_id, "available")
        await inv.release_claims(ctx.conn, ev.allocation_id)


def handlers(scheduler: Scheduler) -> dict:
    return {
        "allocation.accepted": scheduler.on_accepted,
        "allocation.provisioning": scheduler.on_provisioning,
        "allocation.active": scheduler.on_active,
        "allocation.releasing": scheduler.on_releasing,
        "allocation.released": scheduler.on_released,
        "allocation.failed": scheduler.on_failed,
    }
