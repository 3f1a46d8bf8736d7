"""The node rules: whether a node may take a request at all, before the fit (fit.py) picks its slots.

Every rule is named, in the style of the Kubernetes scheduler's Filter plugins: a name (the node's bucket in
the why-not answer's `filtered`), one explanation an operator reads ("3 nodes in maintenance"), and one
predicate on the node's facts and the request. A shape's rules are tried in order and the first that fails
names the node's bucket, so the order is the contract.

Placement checks the same rules in SQL when it looks for and locks a node: adapters/inventory/node_sql.py
maps every rule *name* to one predicate, importing it fails if the names differ, and
tests/integration/test_scheduler_node_rules.py evaluates every rule both ways on the same nodes. Placement
and the why-not answer therefore read one definition, as slot eligibility does (domain/slots.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from gpuaas_common.contract import HostMode, Shape

from .. import nvlink_partitions as nvl
from .fit import NodeCandidate, best_tier
from .request import Request, node_skus


@dataclass(frozen=True)
class NodeFacts:
    """Everything the rules look at for one node (the why-not path reads it for the whole fleet)."""

    node_id: str
    region: str
    sku: str
    accepts_slices: bool
    accepts_baremetal: bool
    mode: str
    schedulable: bool
    draining: bool
    maintenance: bool
    parity_failures: int | None
    live_claims: int
    exclusive_held: bool
    candidate: NodeCandidate
    # The host's cache holds the requested image verified with the requested digest (True when the
    # request has no image gate).
    image_ready: bool = True
    # Approved slots in any status but retired: each still promises its GPU and disk to slices.
    approved_slots: int = 0
    # The last commissioning preflight's verdict (passed / failed / missing); None: never reported.
    preflight_status: str | None = None
    # 1 GiB hugepages: configured on the host as its agent reported (None: never reported), held by its
    # live slot claims, and needed per GPU by its slots' runtime profile (0: the profile does not opt in;
    # see gpuaas_common.profiles).
    hugepages_1g_total: int | None = None
    hugepages_1g_held: int = 0
    hugepages_1g_per_gpu: int = 0
    # Open drift the node agent reported on the node as a whole, and the slots free but for open drift on them.
    drift_open: bool = False
    drifted_free_slots: int = 0
    # The runtime profiles of its slots that opt into hugepages (empty: none does), named by why-not answers.
    hugepage_profiles: tuple[str, ...] = ()
    # (module ID, state) of each unretired GPU slot with a module ID: `free`, `held` (a tenant's, or on its way
    # back from one) or `sick` (unhealthy, disabled, drifted, awaiting a verified wipe). Empty: the host is
    # not placed on NVLink partitions.
    module_states: tuple[tuple[int, str], ...] = ()
    # What the host's Fabric Manager reported at its last discovery; None: not reported.
    fabric_manager_version: str | None = None

    @property
    def partitioned(self) -> bool:
        return bool(self.module_states)

    def gpu_states(self) -> nvl.Host:
        """The host as the partition rules see it, keeping tenant and health apart for the why-not answer."""
        return {mid: nvl.GpuState(free=state == "free", healthy=state != "sick") for mid, state in self.module_states}


# --- the predicates that need more than one line ------------------------------------------------------


def fabric_manager_mismatch(node: NodeFacts, req: Request) -> bool:
    """The guest's driver would not talk to the host's Fabric Manager: a host placed on NVLink partitions
    serves an image that names its driver version only when its Fabric Manager has exactly that version
    (the partitions reference: the versions must match exactly). A host without partitions activates none."""
    return req.driver_version is not None and node.partitioned and node.fabric_manager_version != req.driver_version


def hugepages_needed(node: NodeFacts, req: Request) -> int:
    return node.hugepages_1g_per_gpu * req.gpus


def hugepages_missing(node: NodeFacts, req: Request) -> bool:
    """The host cannot back the request's hugepages even with nothing running: none reported, none
    configured, or fewer than the request needs (runbook: hugepages are a host capability reported before
    a profile that requires them is scheduled)."""
    need = hugepages_needed(node, req)
    return need > 0 and (node.hugepages_1g_total or 0) < need


def hugepages_insufficient(node: NodeFacts, req: Request) -> bool:
    """The host could back them, but the slices it already runs hold the pages."""
    need = hugepages_needed(node, req)
    return need > 0 and (node.hugepages_1g_total or 0) - node.hugepages_1g_held < need


def _free_slots_short(node: NodeFacts, req: Request) -> bool:
    return node.candidate.free_slots < req.gpus


def _free_but_for_drift(node: NodeFacts, req: Request) -> bool:
    """Enough slots but for those with open drift on them: the answer ops can act on."""
    return _free_slots_short(node, req) and node.candidate.free_slots + node.drifted_free_slots >= req.gpus


def _partition_free(node: NodeFacts, req: Request) -> bool:
    """A host placed on NVLink partitions has a free partition of the request's size (one that exists)."""
    return req.gpus in nvl.SIZES and bool(nvl.feasible_partitions(node.gpu_states(), req.gpus))


# --- the rules ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class NodeRule:
    name: str
    # Completes "<n> nodes ...": the why-not answer's words for the nodes that fail it.
    explanation: str
    holds: Callable[[NodeFacts, Request], bool]
    # Whether it judges the node rather than its current occupancy: a node passing every such rule is
    # "eligible", and its free GPUs count in the why-not answer.
    node_level: bool = True
    # The bucket the node lands in when this rule fails it, when that is not the rule's own name.
    bucket: str = ""

    @property
    def filtered_as(self) -> str:
        return self.bucket or self.name


_REGION = NodeRule("region", "in another region", lambda n, r: n.region == r.region)
_SKU = NodeRule("sku", "of another SKU", lambda n, r: n.sku in node_skus(r))
_MAINTENANCE = NodeRule("maintenance", "in maintenance", lambda n, r: not n.maintenance)
_DRAINING = NodeRule("draining", "draining", lambda n, r: not n.draining)
_NOT_READY = NodeRule("not_ready", "not ready", lambda n, r: n.schedulable)
_INTENT = "without the profile intent"
_MODE = "in a host mode that does not serve this shape"
_HELD = "held by another allocation"

SLICE_RULES: tuple[NodeRule, ...] = (
    _REGION,
    _SKU,
    NodeRule("profile_intent", _INTENT, lambda n, r: n.accepts_slices),
    NodeRule("host_mode", _MODE, lambda n, r: n.mode == HostMode.SLICE),
    _MAINTENANCE,
    _DRAINING,
    _NOT_READY,
    # Commissioning decides whether the host is firmware-capable (runbook): no passing preflight, no slices.
    NodeRule("preflight_failed", "whose commissioning preflight failed", lambda n, r: n.preflight_status != "failed"),
    NodeRule("preflight_missing", "without a commissioning preflight", lambda n, r: n.preflight_status == "passed"),
    NodeRule(
        "parity",
        "without parity failures=0",
        lambda n, r: n.parity_failures is not None and not n.parity_failures > 0,
    ),
    NodeRule("drift_reported", "with open drift reported by the node agent", lambda n, r: not n.drift_open),
    NodeRule("image_cache", "without the image verified in cache", lambda n, r: n.image_ready),
    NodeRule(
        "fabric_manager_version",
        "whose Fabric Manager version is not the image's driver version",
        lambda n, r: not fabric_manager_mismatch(n, r),
    ),
    NodeRule(
        "hugepages_missing",
        "without the 1 GiB hugepages their slot profile needs",
        lambda n, r: not hugepages_missing(n, r),
    ),
    NodeRule("in_use", _HELD, lambda n, r: not n.exclusive_held),
    NodeRule(
        "drifted_slots",
        "with open drift reported by the node agent",
        lambda n, r: not _free_but_for_drift(n, r),
        bucket="drift_reported",
    ),
    NodeRule("free_slot_count", "with too few free slots", lambda n, r: not _free_slots_short(n, r), node_level=False),
    NodeRule(
        "hugepages_insufficient",
        "whose free 1 GiB hugepages are held by running slices",
        lambda n, r: not hugepages_insufficient(n, r),
        node_level=False,
    ),
    NodeRule(
        "nvlink_partition",
        "without a free NVLink partition of that size",
        lambda n, r: not n.partitioned or _partition_free(n, r),
        node_level=False,
    ),
    NodeRule(
        "topology",
        "without a topology-safe group",
        lambda n, r: best_tier(n.candidate, r.gpus) is not None,
        node_level=False,
    ),
)

BAREMETAL_RULES: tuple[NodeRule, ...] = (
    _REGION,
    _SKU,
    NodeRule("profile_intent", _INTENT, lambda n, r: n.accepts_baremetal),
    NodeRule("host_mode", _MODE, lambda n, r: n.mode == HostMode.BAREMETAL),
    # A slot promises its GPU and disk to slices; a baremetal tenant owns them all.
    NodeRule("approved_slots", "still holding approved slots", lambda n, r: not n.approved_slots),
    _MAINTENANCE,
    _DRAINING,
    _NOT_READY,
    # The commissioning preflight gates slice capability only: a whole host needs no VFIO firmware.
    NodeRule("in_use", _HELD, lambda n, r: not n.live_claims),
)


def rules_for(shape: str) -> tuple[NodeRule, ...]:
    return BAREMETAL_RULES if shape == Shape.BAREMETAL else SLICE_RULES


def first_failing(node: NodeFacts, req: Request) -> NodeRule | None:
    return next((rule for rule in rules_for(req.shape) if not rule.holds(node, req)), None)


def node_filter(node: NodeFacts, req: Request) -> str | None:
    """The first rule a node fails for this request, as its bucket in `filtered`; None when it passes them all."""
    rule = first_failing(node, req)
    return rule.filtered_as if rule else None


def _one_per_name(*shapes: tuple[NodeRule, ...]) -> dict[str, NodeRule]:
    """Each bucket has one explanation and one level, whichever shape's rule it comes from."""
    by_bucket: dict[str, NodeRule] = {}
    for rule in (r for rules in shapes for r in rules):
        seen = by_bucket.setdefault(rule.filtered_as, rule)
        if (seen.explanation, seen.node_level) != (rule.explanation, rule.node_level):
            raise RuntimeError(f"node rules disagree on bucket {rule.filtered_as!r}")
    for rules in shapes:
        if len({r.name for r in rules}) != len(rules):
            raise RuntimeError("a shape's node rules repeat a name")
    return by_bucket


# Every bucket of `filtered` a rule can name, with the rule that defines its explanation and level.
BUCKETS = _one_per_name(SLICE_RULES, BAREMETAL_RULES)
# The buckets of the rules that judge the node rather than its current occupancy: a node passing them is
# "eligible" and its free GPUs count in the why-not answer.
NODE_LEVEL = frozenset(bucket for bucket, rule in BUCKETS.items() if rule.node_level)
