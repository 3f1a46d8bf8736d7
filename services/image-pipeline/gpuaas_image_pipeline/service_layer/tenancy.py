"""Baremetal tenancies from the bus (domain/tenancy.py says when one is open), and what they change here.

Each handler works in the caller's unit of work and first takes the node's lock (`tenancies.lock_node`), which
slice-host enrolments take too (catalog.on_enrolled, which refuses a tenant's node): a placement and an
enrolment of one node never interleave.

A tenancy that opens takes the node out of the slice hosts at once: it leaves the activation gate (a published
image waits no longer for a host that will not answer, and is activated if every other host verified it), gets
no further prewarm tasks, and its image caches count as absent (the deploy reimages the disk), which the
scheduler learns through `image.node_cache_changed`. Once the tenancy is over the host enrols again as any
slice host does, and proves its cache from scratch.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from gpuaas_common.contract import messages as m
from gpuaas_common.logging import get_logger

from ..domain.tenancy import facts_of, tenancy_state
from .catalog import Uow, leave_slice_hosts

log = get_logger(__name__)

ABSENT_REASON = "the host was handed to a baremetal tenant: its disk is the tenant's"


def concerns(ev: m.AllocationEvent) -> bool:
    """Only baremetal allocations hold a node whole: any other lifecycle event changes no tenancy."""
    return ev.shape == "baremetal"


async def on_lifecycle(uow: Uow, ev: m.AllocationEvent, occurred_at: datetime) -> None:
    """allocation.placed / provisioning / released / failed. Only baremetal allocations hold a node whole."""
    if ev.shape != "baremetal":
        return
    node_id: str | None = getattr(ev, "node_id", None)
    if node_id is None:
        known = await uow.repos.tenancies.get(ev.allocation_id)
        if known is None:
            return  # failed before it was placed: it never held a node
        node_id = known["node_id"]
    assert node_id is not None
    await uow.repos.tenancies.lock_node(node_id)
    facts: dict[str, Any] = {}
    if isinstance(ev, m.AllocationPlaced):
        facts = {"started": True, "placed_at": occurred_at}
    elif isinstance(ev, m.AllocationProvisioning):
        facts = {"started": True, "deploy_sent": True}
    elif isinstance(ev, m.AllocationReleased):
        facts = {"released": True}
    elif isinstance(ev, m.AllocationFailed):
        facts = {"failed": True}
    row = await uow.repos.tenancies.record(ev.allocation_id, node_id, **facts)
    await _judge(uow, row)


async def on_machine_released(uow: Uow, res: m.MaasReleaseResult) -> None:
    """A MAAS release result: a released machine ends its allocation's tenancy (a failed baremetal allocation
    whose deploy went out is released this way, with no lifecycle event after `failed`)."""
    if res.status != "released":
        log.info("machine_release_not_done", node_id=res.node_id, status=res.status, reason_code=res.reason_code)
        return
    await uow.repos.tenancies.lock_node(res.node_id)
    row = await uow.repos.tenancies.record(res.allocation_id, res.node_id, machine_released=True)
    await _judge(uow, row)


async def _judge(uow: Uow, row: dict[str, Any]) -> None:
    state = tenancy_state(facts_of(row))
    opened = state == "open" and not row["open"]
    closed = row["open"] and state != "open"
    await uow.repos.tenancies.judge(row["allocation_id"], open_=state == "open", state=state)
    if opened:
        log.info("baremetal_tenancy_started", node_id=row["node_id"], allocation_id=str(row["allocation_id"]))
        if row["placed_at"] is not None:
            await _supersede_older(uow, row)
        await leave_slice_hosts(uow, row["node_id"], ABSENT_REASON, why="baremetal_tenancy")
    elif closed:
        log.info(
            "baremetal_tenancy_ended", node_id=row["node_id"], allocation_id=str(row["allocation_id"]), reason=state
        )


async def _supersede_older(uow: Uow, row: dict[str, Any]) -> None:
    """The scheduler handed the node to this allocation: a tenancy placed on it before is over."""
    for older in await uow.repos.tenancies.others_placed_before(row["node_id"], row["allocation_id"], row["placed_at"]):
        await _judge(uow, await uow.repos.tenancies.supersede(older, row["allocation_id"]))
