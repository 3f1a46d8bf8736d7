"""Baremetal tenancies: which nodes a baremetal tenant holds, so that none of them joins the slice hosts. Pure.

A baremetal tenant has root on its host and holds the host's allocation-bound NATS creds (user `node-<id>`,
the same per-node template as a slice host's), so it can publish `node.enrolled` with kind `slice_host`. Taken
as it comes, that enrolment would put the tenant's machine into the activation gate and send it prewarm tasks.
The pipeline learns the tenancies from the bus and refuses a slice-host enrolment from a node under one.

A tenancy is the time between the deploy that hands a machine to a tenant and the MAAS release that takes it back:
- it opens with the allocator's `maas.deploy_requested` for the allocation: the deploy with the tenant's keys
  went out to MAAS (the allocator sends it in the unit of work that applies the placement, so no event of the
  allocation comes between the two). The scheduler's deploys (a host walk's, with the slice-host profile) hand
  the node to nobody;
- it ends when MAAS reports the machine released for that allocation (`maas.release_result`, status
  `released`). Every way a deployed allocation ends goes there: a release, and a failure after the deploy (the
  allocator releases the failed machine at once). A release that fails leaves it open: the machine may still run
  the tenant's image with the tenant's keys;
- or when a later baremetal allocation's deploy goes to the same node (the scheduler handed the node out again,
  so the machine was redeployed for someone else).

An allocation that never reached its deploy (failed or released before it, a slice) never held a node whole. The
pipeline follows the MAAS stream only, where every message is about a machine: it followed the allocations'
lifecycle before, whose subjects name no shape, so every slice allocation's events reached it to be parsed and
acknowledged unread (~0.7 ms of its CPU per allocation in the pipeline benchmark, 5 % of the control plane's).

Each fact is only ever set, never cleared, so the judgement is the same whatever order the events are handled
in (replicas may handle one allocation's messages out of order for a moment; the release result comes on
another durable and may be seen first).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

TenancyState = Literal["open", "not_deployed", "machine_released", "superseded"]

# The dead-letter reason of a refused enrolment (contract: DeadLetter.reason_code).
REFUSED_ENROLMENT = "baremetal_tenancy"


@dataclass(frozen=True)
class TenancyFacts:
    """What the pipeline has seen of one baremetal allocation."""

    deployed: bool = False  # its deploy went out to MAAS (maas.deploy_requested)
    machine_released: bool = False  # MAAS released its machine (maas.release_result released)
    superseded: bool = False  # a later baremetal allocation's deploy went to the node


def tenancy_state(facts: TenancyFacts) -> TenancyState:
    """`open` while the node is the tenant's; otherwise why not (not yet, or how it ended)."""
    if facts.machine_released:
        return "machine_released"
    if facts.superseded:
        return "superseded"
    if not facts.deployed:
        return "not_deployed"
    return "open"


def facts_of(row: dict[str, object]) -> TenancyFacts:
    """The facts a stored tenancy row holds."""
    return TenancyFacts(
        deployed=bool(row["deployed"]),
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
