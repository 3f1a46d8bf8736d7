"""Placement as small pure functions, in the style of the Kubernetes scheduler framework, one concern a module:

- `request`: the request's facts, decided once before any node is looked at (`Request`, `image_gate`);
- `fit`: which slots of a host a slice takes (`choose`, NVLink partitions), the host's capacity summary, the
  scores that rank hosts, and the search's final choice (`pick_slots`);
- `rules`: the named node rules a node must pass (`SLICE_RULES`, `BAREMETAL_RULES`), each with its SQL twin in
  adapters/inventory/node_sql.py;
- `explain`: the why-not answer's reason code and sentence.

Each module reads only those listed above it (an import contract holds them to it). The names below are the
package's interface: callers import them from here.
"""

from .explain import HUGEPAGE_FILTERS, fabric_manager_note, hugepage_note, partition_summary, unschedulable_summary
from .fit import (
    HALF,
    SCORERS,
    TIER_NAMES,
    TIER_NUMA,
    TIER_SPAN,
    TIER_SWITCH,
    Choice,
    NodeCandidate,
    SlotPick,
    SlotView,
    best_tier,
    choose,
    choose_partition,
    choose_slots,
    clean_node_allowed,
    dedupe_fabric,
    node_score,
    numa_span_needed,
    partition_tier,
    partitioned,
    pick_slots,
    rank_classes,
    rank_nodes,
    score_fit,
    score_sliced,
    score_topology,
    summarize,
)
from .request import BAREMETAL_GPUS, WHOLE_HOST_SKU, Request, image_gate, node_skus
from .rules import (
    BAREMETAL_RULES,
    BUCKETS,
    NODE_LEVEL,
    SLICE_RULES,
    NodeFacts,
    NodeRule,
    fabric_manager_mismatch,
    first_failing,
    hugepages_insufficient,
    hugepages_missing,
    hugepages_needed,
    node_filter,
    rules_for,
)

__all__ = [
    "BAREMETAL_GPUS",
    "BAREMETAL_RULES",
    "BUCKETS",
    "HALF",
    "HUGEPAGE_FILTERS",
    "NODE_LEVEL",
    "SCORERS",
    "SLICE_RULES",
    "TIER_NAMES",
    "TIER_NUMA",
    "TIER_SPAN",
    "TIER_SWITCH",
    "WHOLE_HOST_SKU",
    "Choice",
    "NodeCandidate",
    "NodeFacts",
    "NodeRule",
    "Request",
    "SlotPick",
    "SlotView",
    "best_tier",
    "choose",
    "choose_partition",
    "choose_slots",
    "clean_node_allowed",
    "dedupe_fabric",
    "fabric_manager_mismatch",
    "fabric_manager_note",
    "first_failing",
    "hugepage_note",
    "hugepages_insufficient",
    "hugepages_missing",
    "hugepages_needed",
    "image_gate",
    "node_filter",
    "node_score",
    "node_skus",
    "numa_span_needed",
    "partition_summary",
    "partition_tier",
    "partitioned",
    "pick_slots",
    "rank_classes",
    "rank_nodes",
    "rules_for",
    "score_fit",
    "score_sliced",
    "score_topology",
    "summarize",
    "unschedulable_summary",
]
