"""Inventory and claims in Postgres: seeding, the capacity summary, index-ordered candidates,
node-locked SKIP LOCKED claims, slot transitions and release.

Locking protocol: every change to a node's slots or claims happens under that node's row lock
(`FOR UPDATE`). Placement takes it with SKIP LOCKED, so concurrent workers spread over the next
nodes in rank order instead of queueing on the best one; release, repair and admin changes wait for
it. The DB unique indexes on live claims are the last line of defence either way.

The package re-exports every name below, so callers keep `from ..adapters import inventory as inv`:

- `predicates`: the shared SQL fragments (counted and free slot, image gate, hugepages, tiers) and row mappers;
- `node_sql`: the node rules of domain/placement/rules.py as SQL, one predicate per rule, and which rules each
  placement query checks;
- `seeding`: nodes and slots from the fleet file;
- `capacity`: the per-node capacity summary and the fleet's shape;
- `candidates`: nodes in rank order, the image gate, the facts behind "why not";
- `claims`: node-locked claims of slots and whole nodes, and the quota checks;
- `slot_transitions`: logged slot moves, node locks and drains, claim release.
"""

from ...domain.placement import Request
from .candidates import (
    baremetal_candidates,
    count_clean_nodes,
    missed_slice_candidates,
    node_facts,
    slice_candidates,
)
from .capacity import fleet_shape, refresh_nodes
from .claims import (
    LOCKED,
    Prelude,
    claim_slots,
    free_slots_locked,
    lock_best_in_class,
    lock_slice_node,
    prelude,
    tenant_usage_locked,
    try_claim_baremetal,
)
from .node_sql import BAREMETAL_NODE_SQL, SLICE_NODE_SQL
from .predicates import (
    COUNTED_SLOT_SQL,
    FREE_SLOT_SQL,
    MODULE_STATES_SQL,
    NODE_SUMMARY_COLUMNS,
    SLOT_COLUMNS,
    candidate_from_row,
    image_ready_sql,
)
from .seeding import SEED_SOURCE, TAG_BAREMETAL, TAG_SLICE, seed_from_fleet
from .slot_transitions import (
    allocation_lock_key,
    allocation_slots,
    drain_node,
    lock_allocation,
    lock_clean_watermark,
    lock_nodes,
    move_slots,
    release_claims,
    set_slot_status,
    slots_reached,
)

__all__ = [
    "BAREMETAL_NODE_SQL",
    "COUNTED_SLOT_SQL",
    "FREE_SLOT_SQL",
    "LOCKED",
    "MODULE_STATES_SQL",
    "NODE_SUMMARY_COLUMNS",
    "SEED_SOURCE",
    "SLICE_NODE_SQL",
    "SLOT_COLUMNS",
    "TAG_BAREMETAL",
    "TAG_SLICE",
    "Request",
    "allocation_slots",
    "baremetal_candidates",
    "candidate_from_row",
    "claim_slots",
    "count_clean_nodes",
    "drain_node",
    "fleet_shape",
    "free_slots_locked",
    "image_ready_sql",
    "lock_best_in_class",
    "allocation_lock_key",
    "lock_allocation",
    "lock_clean_watermark",
    "lock_nodes",
    "lock_slice_node",
    "move_slots",
    "node_facts",
    "Prelude",
    "prelude",
    "refresh_nodes",
    "release_claims",
    "seed_from_fleet",
    "set_slot_status",
    "slice_candidates",
    "missed_slice_candidates",
    "slots_reached",
    "tenant_usage_locked",
    "try_claim_baremetal",
]
