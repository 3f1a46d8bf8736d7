"""What becomes of an allocation's live claims, given what the allocation's owner — the allocator — says of it.

The scheduler learns that an allocation ended from its lifecycle events. A Postgres that loses acknowledged
commits (an asynchronous standby promoted, `synchronous_commit` off) can lose the scheduler's handling of
`released` after the message was acknowledged: JetStream never delivers it again and the claims would be held
for good, their slots lost to every tenant (a chaos run found exactly that). So the scheduler audits its claims
against the owner, and the owner's word settles them.

Settling is conservative. The audit has no wipe proof (that travelled in the lost event), so every slot goes to
`cleanup_blocked`, where only a repair with a verified wipe frees it; a node held whole is drained for ops unless
the owner says the allocation was released — a baremetal release ends only once MAAS has taken the machine back.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Literal

from gpuaas_common.contract import AllocationState

# The allocator's states in which an allocation holds nothing any more.
ENDED = frozenset({AllocationState.RELEASED, AllocationState.FAILED, AllocationState.UNSCHEDULABLE})

Action = Literal["keep", "release", "report"]


@dataclass(frozen=True)
class AuditFacts:
    """One allocation as the audit sees it: the owner's answer and the claims held here."""

    owner_state: str | None  # None: the allocator has no record of the allocation
    owner_node: str | None
    claim_nodes: Collection[str]
    claims_age_s: float  # since the oldest live claim was made
    owner_changed_age_s: float = 0.0  # since the allocator last changed the allocation


@dataclass(frozen=True)
class Settlement:
    action: Action
    reason: str
    # The owner says the allocation was released: a machine held whole is back with MAAS, not left to ops.
    machine_returned: bool = False


def settle(facts: AuditFacts, orphan_after_s: float, end_grace_s: float) -> Settlement:
    """`keep` the claims, `release` them (slots to cleanup_blocked), or keep them and `report` a disagreement
    only ops can resolve. An end younger than `end_grace_s` is left to its event, which carries the wipe proof."""
    if facts.owner_state is None:
        if facts.claims_age_s < orphan_after_s:
            return Settlement("keep", "the allocator has no record yet; its asker may still ask again")
        return Settlement(
            "release",
            f"the allocator has had no record of the allocation for {facts.claims_age_s:.0f} s "
            f"(orphans are released after {orphan_after_s:g} s)",
        )
    if facts.owner_state in ENDED:
        if facts.owner_changed_age_s < end_grace_s:
            return Settlement("keep", f"the allocator says {facts.owner_state}; its event may still be on its way")
        return Settlement(
            "release",
            f"the allocator says {facts.owner_state}, but its end never reached the scheduler",
            machine_returned=facts.owner_state == "released",
        )
    if facts.owner_node is not None and facts.owner_node not in facts.claim_nodes:
        # Two records of where the tenant runs: releasing either side could free a device in use.
        return Settlement(
            "report",
            f"the allocator places it on {facts.owner_node}, its claims are on {', '.join(sorted(facts.claim_nodes))}",
        )
    return Settlement("keep", f"the allocator says {facts.owner_state}")
