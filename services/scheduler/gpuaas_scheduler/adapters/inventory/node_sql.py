"""The node rules of domain/placement/rules.py (`SLICE_RULES`, `BAREMETAL_RULES`) as SQL over `nodes n`.

One predicate per rule *name* and shape; importing this module fails if a rule has no predicate or a predicate
no rule, and tests/integration/test_scheduler_node_rules.py evaluates every rule both ways, Python on the facts
the why-not answer reads and SQL on the rows they come from, on the same nodes.

A predicate names the request's parameters it reads (`${region}`, `${gpus}`, ...: see `PARAMETERS`) and each
query that checks it numbers them (`rules_sql(..., region=1, gpus=3)`): the queries keep their own `$n`.
"""

from __future__ import annotations

import string
from collections.abc import Iterable

from gpuaas_common.contract import Shape

from ...domain import nvlink_partitions as nvl
from ...domain.placement.rules import BAREMETAL_RULES, SLICE_RULES, NodeRule
from .predicates import (
    FREE_SLOT_SQL,
    SLOT_DRIFT_SQL,
    UNCLAIMED_SLOT_SQL,
    fabric_manager_ok_sql,
    hugepages_ok_sql,
    hugepages_per_gpu_sql,
    image_ready_sql,
)

# What a predicate may read of the request, each a query parameter: region, the SKU a slice asks for, the node
# SKUs a baremetal request may take (text[]), GPUs, the image gate's slug and digest (NULL: no gate), the
# image's driver version (NULL: none named) and the hugepage table (`predicates.hugepage_table()`).
PARAMETERS = ("region", "sku", "skus", "gpus", "slug", "digest", "driver", "pages")

_PER_GPU = hugepages_per_gpu_sql("{pages}")
_MODULE_SLOTS = "s.node_id = n.node_id AND s.module_id IS NOT NULL AND s.status <> 'retired'"
_PARTITIONS = ", ".join(f"(ARRAY{sorted(p.modules)})" for p in nvl.PARTITIONS)
_COMMON = {
    "region": "n.region = ${region}",
    "maintenance": "NOT n.maintenance",
    "draining": "NOT n.draining",
    "not_ready": "n.schedulable",
}

SLICE_RULE_SQL: dict[str, str] = {
    **_COMMON,
    # Equality, not ANY: the rank index (region, sku, ...) then yields candidates in order without a sort.
    "sku": "n.sku = ${sku}",
    "profile_intent": "n.accepts_slices",
    "host_mode": "n.mode = 'slice'",
    "preflight_failed": "n.preflight_status IS DISTINCT FROM 'failed'",
    "preflight_missing": "n.preflight_status = 'passed'",
    "parity": "n.parity_failures = 0",
    "drift_reported": "NOT n.drift_open",
    "image_cache": image_ready_sql("{slug}", "{digest}"),
    "fabric_manager_version": fabric_manager_ok_sql("{driver}"),
    "hugepages_missing": f"{_PER_GPU} = 0 OR COALESCE(n.hugepages_1g_total, 0) >= {_PER_GPU} * ${{gpus}}",
    "in_use": (
        "NOT EXISTS (SELECT 1 FROM allocation_resource_claims c WHERE c.node_id = n.node_id "
        "AND c.claim_kind = 'node_exclusive' AND c.status <> 'released')"
    ),
    "drifted_slots": (
        "n.free_slots >= ${gpus} OR n.free_slots + (SELECT count(*) FROM node_resource_slots s "
        f"WHERE s.node_id = n.node_id AND {UNCLAIMED_SLOT_SQL} AND {SLOT_DRIFT_SQL}) < ${{gpus}}"
    ),
    "free_slot_count": "n.free_slots >= ${gpus}",
    "hugepages_insufficient": hugepages_ok_sql("{gpus}", "{pages}"),
    # The domain's `feasible_partitions` over the host's free GPUs (`MODULE_STATES_SQL`'s `free`), on a host
    # with module IDs; module IDs are unique on a host (approval refuses a map that repeats one).
    "nvlink_partition": (
        f"NOT EXISTS (SELECT 1 FROM node_resource_slots s WHERE {_MODULE_SLOTS}) "
        f"OR EXISTS (SELECT 1 FROM (VALUES {_PARTITIONS}) p(modules) WHERE cardinality(p.modules) = ${{gpus}} "
        f"AND p.modules <@ ARRAY(SELECT s.module_id::int FROM node_resource_slots s WHERE {_MODULE_SLOTS} "
        f"AND {FREE_SLOT_SQL}))"
    ),
    # The domain's `best_tier` on the capacity summary: one switch, one NUMA node, or the fewest NUMA nodes.
    "topology": (
        "n.free_slots >= ${gpus} AND (${gpus} = 1 OR n.max_switch_free >= ${gpus} OR CASE "
        "WHEN n.numa_capacity <= 0 OR ${gpus} <= n.numa_capacity THEN COALESCE(n.numa_free[1], 0) >= ${gpus} "
        "ELSE (SELECT COALESCE(sum(f), 0) FROM unnest(n.numa_free[1:(${gpus} + n.numa_capacity - 1) "
        "/ n.numa_capacity]) f) >= ${gpus} END)"
    ),
}

BAREMETAL_RULE_SQL: dict[str, str] = {
    **_COMMON,
    "sku": "n.sku = ANY(${skus}::text[])",
    "profile_intent": "n.accepts_baremetal",
    "host_mode": "n.mode = 'baremetal'",
    "approved_slots": (
        "NOT EXISTS (SELECT 1 FROM node_resource_slots s WHERE s.node_id = n.node_id AND s.status <> 'retired')"
    ),
    "in_use": (
        "NOT EXISTS (SELECT 1 FROM allocation_resource_claims c WHERE c.node_id = n.node_id AND c.status <> 'released')"
    ),
}

_BY_SHAPE: dict[str, tuple[tuple[NodeRule, ...], dict[str, str]]] = {
    Shape.GPU_SLICE: (SLICE_RULES, SLICE_RULE_SQL),
    Shape.BAREMETAL: (BAREMETAL_RULES, BAREMETAL_RULE_SQL),
}


def parameters(template: str) -> set[str]:
    """The request parameters a predicate reads."""
    return {field for _, field, _, _ in string.Formatter().parse(template) if field is not None}


for _shape, (_rules, _sql) in _BY_SHAPE.items():
    _names = {r.name for r in _rules}
    if set(_sql) != _names:
        raise RuntimeError(f"{_shape} node rules and their SQL differ: {sorted(set(_sql) ^ _names)}")
    for _name, _template in _sql.items():
        if not parameters(_template) <= set(PARAMETERS):
            raise RuntimeError(f"{_shape} rule {_name} reads {sorted(parameters(_template) - set(PARAMETERS))}")


def rule_sql(shape: str, name: str, **params: int) -> str:
    """One rule's predicate with the caller's parameter numbers."""
    return _BY_SHAPE[shape][1][name].format(**params)


# A rule that holds wherever another one holds, for any node and request: checked together, the query needs the
# stronger one alone. Leaving the weaker one out keeps the rank walk's statements as cheap as they were: with
# them, the fast path's generic plan (which Postgres picks for a statement prepared once and run many times)
# took 100 ms instead of 0.5. The why-not answer still names the weaker one, first in the domain's order; the
# rules' test checks every implication on every node.
IMPLIED_BY: dict[str, str] = {
    "preflight_failed": "preflight_missing",  # a passed preflight is not a failed one
    "hugepages_missing": "hugepages_insufficient",  # pages held by live claims are never negative
    "drifted_slots": "free_slot_count",  # enough free slots are not short of them, drift or not
}


def rules_sql(shape: str, names: Iterable[str], **params: int) -> str:
    """The conjunction of the named rules of a shape, in the shape's rule order, without the rules another of
    them implies (`IMPLIED_BY`)."""
    wanted = set(names)
    rules, sql = _BY_SHAPE[shape]
    unknown = wanted - set(sql)
    if unknown:
        raise KeyError(f"no {shape} node rule {sorted(unknown)}")
    checked = {name for name in wanted if IMPLIED_BY.get(name) not in wanted}
    return " AND ".join(f"({sql[r.name].format(**params)})" for r in rules if r.name in checked)


def all_but(shape: str, *names: str) -> tuple[str, ...]:
    return tuple(r.name for r in _BY_SHAPE[shape][0] if r.name not in names)


# Which rules each placement query checks.
#
# A slice host in service whatever the request asks (the clean-host watermark counts these): the rules that
# read the node row alone. The rank index `nodes_slice_rank` is partial on most of them.
SLICE_HOST = (
    "profile_intent",
    "host_mode",
    "maintenance",
    "draining",
    "not_ready",
    "preflight_failed",
    "preflight_missing",
    "parity",
    "drift_reported",
)
# The index walk and the fast path: every slice rule but the two `choose` decides on the node's locked free
# slots (a topology-safe group, a free NVLink partition); the walk narrows topology by rank class
# (`predicates.TIER_SQL`) instead.
SLICE_CANDIDATE = all_but(Shape.GPU_SLICE, "nvlink_partition", "topology")
# A node the walk found, locked by id: what may have changed since it was listed; its capacity is judged on its
# locked slots by `choose`.
SLICE_LOCKED = all_but(
    Shape.GPU_SLICE, "region", "sku", "drifted_slots", "free_slot_count", "nvlink_partition", "topology"
)
# A baremetal host that may be handed out whole, busy or not (its live claims are checked under its lock).
BAREMETAL_HOST = all_but(Shape.BAREMETAL, "region", "sku", "in_use")
BAREMETAL_CANDIDATE = all_but(Shape.BAREMETAL)

SLICE_NODE_SQL = rules_sql(Shape.GPU_SLICE, SLICE_HOST)
BAREMETAL_NODE_SQL = rules_sql(Shape.BAREMETAL, BAREMETAL_HOST)
