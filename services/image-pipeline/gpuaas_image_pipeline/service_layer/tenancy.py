"""Baremetal tenancies from the bus (domain/tenancy.py says when one is open), and what they change here.

Each handler works in the caller's unit of work and first takes the node's lock (`tenancies.lock_node`), which
slice-host enrolments take too (catalog.on_enrolled, which refuses a tenant's node): a deploy and an
enrolment of one node never interleave.

A tenancy that opens takes the node out of the slice hosts at once: it leaves the activation gate (a published
image waits no longer for a host that will not answer, and is activated if every other host verified it), gets
no further prewarm tasks, and its image caches count as absent (the deploy reimages the disk), which the
scheduler learns through `image.node_cache_changed`. Once the tenancy is over the host enrols again as any
slice host does, and proves its cache from scratch.
"""

from __future__ import annotations

from typing import Any

from gpuaas_common.contract import Envelope
from gpuaas_common.contract import messages as m
from gpuaas_common.logging import get_logger

from ..domain.tenancy import facts_of, tenancy_state
from .catalog import Uow, leave_slice_hosts

log = get_logger(__name__)

ABSENT_REASON = "the host was handed to a baremetal tenant: its disk is the tenant's"


# Who sends a tenant's deploy (the contract's maas.deploy_requested): the scheduler sends the other kind, a host
# walk's redeploy with the slice-host profile. Only the two may publish on the subject (their NATS identities).
TENANT_DEPLOYER = "allocator"


async def on_deploy_requested(uow: Uow, cmd: m.MaasDeployRequested, envelope: Envelope) -> None:
    """maas.deploy_requested: a baremetal allocation's deploy went out to MAAS, and the node is the tenant's from
    now on. A host walk's deploy (the scheduler's) hands the node to no tenant."""
    if envelope.producer != TENANT_DEPLOYER:
        log.info("deploy_not_a_tenancy", node_id=cmd.node_id, producer=envelope.producer)
        return
    await uow.repos.tenancies.lock_node(cmd.node_id)
    row = await uow.repos.tenancies.record(cmd.allocation_id, cmd.node_id, deployed_at=envelope.occurred_at)
    await _judge(uow, row)


async def on_machine_released(uow: Uow, res: m.MaasReleaseResult) -> None:
    """A MAAS release result: a released machine ends its allocation's tenancy (every deployed allocation's
    machine is released this way: at its release, or at once when it failed after the deploy)."""
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
        await _supersede_older(uow, row)  # open means deployed, so deployed_at is set
        await leave_slice_hosts(uow, row["node_id"], ABSENT_REASON, why="baremetal_tenancy")
    elif closed:
        log.info(
            "baremetal_tenancy_ended", node_id=row["node_id"], allocation_id=str(row["allocation_id"]), reason=state
        )


async def _supersede_older(uow: Uow, row: dict[str, Any]) -> None:
    """The node was deployed for this allocation: a tenancy deployed on it before is over."""
    deployed_before = await uow.repos.tenancies.others_deployed_before(
        row["node_id"], row["allocation_id"], row["deployed_at"]
    )
    for older in deployed_before:
        await _judge(uow, await uow.repos.tenancies.supersede(older, row["allocation_id"]))
