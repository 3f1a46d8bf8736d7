"""Baremetal tenancies: which nodes a baremetal tenant holds, so that none of them joins the slice hosts. Pure.

A baremetal tenant has root on its host and holds the host's allocation-bound NATS creds (user `node-<id>`,
the same per-node template as a slice host's), so it can publish `node.enrolled` with kind `slice_host`. Taken
as it comes, that enrolment would put the tenant's machine into the activation gate and send it prewarm tasks.
The pipeline learns the tenancies from the bus (the allocator's lifecycle events, the gateway's MAAS release
results) and refuses a slice-host enrolment from a node under one.

When a tenancy is open, and when it ends:
- it starts when the allocation is placed on the node (`allocation.placed`, shape baremetal; or its
  `provisioning`, should that be seen first): the node is the allocation's from then on, before the deploy;
- it ends with `allocation.released` (the machine was released through MAAS: the gateway revoked the host's
  allocation user first, and MAAS erased the disk per the site profile);
- a failed allocation whose deploy never went out (no `provisioning`) ends at `allocation.failed`: the tenant
  never got the machine;
- a failed allocation whose deploy went out stays a tenancy until the machine is released (the allocator
  releases it through MAAS at once; `maas.release_result` with status `released` ends it). A release that
  fails leaves it open: the machine may still run the tenant's image with the tenant's keys;
- a later baremetal allocation placed on the same node supersedes it (the scheduler handed the node out
  again, so the machine was redeployed for someone else).

Each fact is only ever set, never cleared, so the judgement is the same whatever order the events are handled
in (replicas may handle one allocation's events out of order for a moment).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

TenancyState = Literal["open", "not_started", "released", "machine_released", "failed_before_deploy", "superseded"]

# The dead-letter reason of a refused enrolment (contract: DeadLetter.reason_code).
REFUSED_ENROLMENT = "baremetal_tenancy"


@dataclass(frozen=True)
class TenancyFacts:
    """What the pipeline has seen of one baremetal allocation."""

    started: bool = False
    deploy_sent: bool = False
    released: bool = False
    failed: bool = False
    machine_released: bool = False
    superseded: bool = False


def tenancy_state(facts: TenancyFacts) -> TenancyState:
    """`open` while the node is the tenant's; otherwise why not (not yet, or how it ended)."""
    if facts.released:
        return "released"
    if facts.machine_released:
        return "machine_released"
    if facts.superseded:
        return "superseded"
    if facts.failed and not facts.deploy_sent:
        return "failed_before_deploy"
    if not facts.started:
        return "not_started"
    return "open"


def facts_of(row: dict[str, object]) -> TenancyFacts:
    """The facts a stored tenancy row holds."""
    return TenancyFacts(
        started=bool(row["started"]),
        deploy_sent=bool(row["deploy_sent"]),
        released=bool(row["released"]),
        failed=bool(row["failed"]),
        machine_released=bool(row["machine_released"]),
        superseded=row["superseded_by"] is not None,
    )


def refusal_reason(node_id: str, allocation_ids: list[str]) -> str:
    """Why a slice-host enrolment from `node_id` is refused while these allocations hold it."""
    held = ", ".join(allocation_ids)
    return (
        f"node {node_id} is under a baremetal tenancy (allocation {held}): a tenant's host cannot enrol as a "
        "slice host until its machine is released"
    )
