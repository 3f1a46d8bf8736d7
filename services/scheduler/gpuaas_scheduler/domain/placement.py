"""Placement as small pure functions, in the style of the Kubernetes scheduler framework.

Filters say why a node cannot take a request (the first failing filter names the node's bucket in
the why-not answer); scorers order the nodes that pass. The order is lexicographic over the scorers
in `SCORERS` and ends on the node id, so the same inventory and the same request always give the
same choice:

1. `score_sliced`   — already-sliced hosts first: clean hosts stay whole for baremetal and 8-GPU slices.
2. `score_topology` — the tightest topology the node can offer for the request: one PCIe switch (0),
                      one NUMA node (1), the fewest NUMA nodes the request can span (2).
3. `score_fit`      — best fit: the fewest free slots left over on the node.
4. node id.

A group is *topology-safe* when it spans no more NUMA nodes than the request needs
(ceil(gpus / slots per NUMA node on that host)); slots of unknown NUMA node never join a multi-GPU
group. A hard filter, so a 4-GPU VM never straddles the inter-socket link when the host could keep
it on one socket.

The adapter enumerates nodes in exactly this order from an index (see `rank_classes`), so Postgres
never sorts the fleet and the ranking stays testable here.

**NVLink partitions.** On a host whose free slots carry GPU module IDs (discovery mapped them, approval
checked the map: domain/approval.py), a slice takes exactly one Fabric Manager partition
(domain/nvlink_partitions.py): 1, 2, 4 or 8 GPUs, all free and healthy, chosen in buddy order inside the host.
Its capacity summary is then written in partition terms so the same tiers and index still rank it: the
largest free partition of at most 2 GPUs stands for its PCIe-switch group, of at most 4 for its NUMA node,
and each half's largest free partition for that node's free slots (a half is its NUMA node). A host whose
slots carry no module IDs (emulated lab slots, slots approved from older evidence) keeps the PCIe-switch and
NUMA rules.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from . import nvlink_partitions as nvl

TIER_SWITCH, TIER_NUMA, TIER_SPAN = 0, 1, 2
TIER_NAMES = {TIER_SWITCH: "one PCIe switch", TIER_NUMA: "one NUMA node", TIER_SPAN: "minimal NUMA span"}
BAREMETAL_GPUS = 8


@dataclass(frozen=True)
class SlotView:
    slot_id: str
    numa_node: int | None
    pcie_switch: str | None
    fabric_device: str | None = None
    module_id: int | None = None


@dataclass(frozen=True)
class Choice:
    slots: tuple[SlotView, ...]
    tier: int
    # The Fabric Manager partition the slots form; None on a host placed without partitions.
    partition: int | None = None


@dataclass(frozen=True)
class NodeCandidate:
    """A node as the ranking sees it: its capacity summary, computed from its free slots."""

    node_id: str
    free_slots: int
    total_slots: int
    live_claims: int = 0
    max_switch_free: int = 0
    numa_free: tuple[int, ...] = ()
    numa_capacity: int = 0

    @property
    def sliced(self) -> bool:
        return self.live_claims > 0 or self.free_slots < self.total_slots

    @property
    def max_numa_free(self) -> int:
        return self.numa_free[0] if self.numa_free else 0


@dataclass(frozen=True)
class Request:
    shape: str  # gpu_slice | baremetal
    gpus: int
    region: str
    sku: str
    tenant_id: str = ""
    # (slug, digest) when the image cache gate applies to this request (see `image_gate` below);
    # None: no cache evidence is required.
    image_gate: tuple[str, str] | None = None
    # The NVIDIA driver inside the guest image (the catalog's); None: the image names none, no version gate.
    driver_version: str | None = None


@dataclass(frozen=True)
class NodeFacts:
    """Everything the filters look at for one node (the why-not path reads it for the whole fleet)."""

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


HUGEPAGE_FILTERS = ("hugepages_missing", "hugepages_insufficient")


def hugepage_note(nodes: Iterable[NodeFacts], per_gpu: dict[str, int]) -> str:
    """Which runtime profiles asked the hugepages the `HUGEPAGE_FILTERS` nodes lack: an operator can then give
    the hosts pages or approve their slots with a plain profile. Empty when no profile asked."""
    names = sorted({p for n in nodes for p in n.hugepage_profiles})
    if not names:
        return ""
    return "; 1 GiB hugepages asked by " + ", ".join(f"profile {p} ({per_gpu.get(p, 0)} per GPU)" for p in names)


# --- slots ----------------------------------------------------------------------------------------


def dedupe_fabric(slots: Iterable[SlotView]) -> list[SlotView]:
    """Slots sharing a fabric device exclude each other: keep the lowest id of each device."""
    seen: set[str] = set()
    out = []
    for slot in sorted(slots, key=lambda s: s.slot_id):
        if slot.fabric_device:
            if slot.fabric_device in seen:
                continue
            seen.add(slot.fabric_device)
        out.append(slot)
    return out


def numa_span_needed(gpus: int, numa_capacity: int) -> int:
    return 1 if gpus <= 1 or numa_capacity <= 0 else math.ceil(gpus / numa_capacity)


K = TypeVar("K", bound=Hashable)


def _groups(slots: Sequence[SlotView], key: Callable[[SlotView], K]) -> dict[K, list[SlotView]]:
    out: dict[K, list[SlotView]] = {}
    for slot in slots:
        out.setdefault(key(slot), []).append(slot)
    return out


def _switch_key(slot: SlotView) -> tuple[object, object]:
    # A slot without a known switch is a switch of its own.
    return (slot.numa_node, slot.pcie_switch) if slot.pcie_switch is not None else ("solo", slot.slot_id)


def partitioned(slots: Iterable[SlotView]) -> bool:
    """Whether slots are placed on NVLink partitions: any of them carries a module ID."""
    return any(s.module_id is not None for s in slots)


def _by_module(free: Sequence[SlotView]) -> dict[int, SlotView]:
    """Free slots by module ID. A module ID two free slots claim (approval refuses that) is trusted for
    neither: placing on it could hand one GPU of a partition twice."""
    counts = Counter(s.module_id for s in free if s.module_id is not None)
    return {s.module_id: s for s in free if s.module_id is not None and counts[s.module_id] == 1}


HALF = 4


def partition_tier(size: int) -> int:
    return TIER_SWITCH if size <= 2 else TIER_NUMA if size <= 4 else TIER_SPAN


def choose_partition(slots: Iterable[SlotView], gpus: int) -> Choice | None:
    """The free slots of the host's best partition of `gpus` GPUs in buddy order, or None: a size no partition
    has, or no partition of that size whose GPUs are all free (a degraded, excluded, drifted or claimed GPU
    is not among the free slots, so every partition holding it is out)."""
    modules = _by_module(dedupe_fabric(slots))
    best = nvl.best_partition({mid: nvl.GpuState() for mid in modules}, gpus)
    if best is None:
        return None
    chosen = tuple(sorted((modules[mid] for mid in best.modules), key=lambda s: s.slot_id))
    return Choice(chosen, partition_tier(best.size), best.partition_id)


def choose(slots: Iterable[SlotView], gpus: int, numa_capacity: int | None = None) -> Choice | None:
    """The topology-safe group for `gpus` on one node, best fit bottom-up, or None; on a partitioned host
    (see `partitioned`) its best NVLink partition.

    Best fit at each level of the hierarchy keeps whole PCIe-switch pairs and whole NUMA nodes free
    for the larger requests that need them."""
    slots = list(slots)
    if partitioned(slots):
        return choose_partition(slots, gpus)
    free = dedupe_fabric(slots)
    if len(free) < gpus or gpus < 1:
        return None
    if numa_capacity is None:
        numa_capacity = max(
            (len(g) for k, g in _groups(free, lambda s: s.numa_node).items() if k is not None), default=0
        )
    by_switch = _groups(free, _switch_key)
    by_numa = _groups(free, lambda s: s.numa_node)
    switch_free = {k: len(g) for k, g in by_switch.items()}
    numa_free = {k: len(g) for k, g in by_numa.items()}

    def fill_order(pool: Iterable[SlotView]) -> list[SlotView]:
        # Inside a container take broken switches first, so intact pairs survive.
        return sorted(pool, key=lambda s: (switch_free[_switch_key(s)], str(_switch_key(s)), s.slot_id))

    if gpus == 1:
        best = min(
            free,
            key=lambda s: (
                switch_free[_switch_key(s)],
                numa_free[s.numa_node] if s.numa_node is not None else 0,
                s.slot_id,
            ),
        )
        return Choice((best,), TIER_SWITCH)
    known = [s for s in free if s.numa_node is not None]
    switches = [g for k, g in by_switch.items() if k[0] != "solo" and k[0] is not None and len(g) >= gpus]
    if switches:
        group = min(switches, key=lambda g: (len(g), numa_free[g[0].numa_node], g[0].slot_id))
        return Choice(tuple(sorted(group, key=lambda s: s.slot_id)[:gpus]), TIER_SWITCH)
    span = numa_span_needed(gpus, numa_capacity)
    numas = {k: g for k, g in by_numa.items() if k is not None}
    if span == 1:
        fitting = [g for g in numas.values() if len(g) >= gpus]
        if not fitting:
            return None
        group = min(fitting, key=lambda g: (len(g), g[0].numa_node))
        return Choice(tuple(fill_order(group)[:gpus]), TIER_NUMA)
    ordered = sorted(numas.items(), key=lambda kv: (-len(kv[1]), kv[0]))[:span]
    if sum(len(g) for _, g in ordered) < gpus or len(known) < gpus:
        return None
    picked: list[SlotView] = []
    for _, group in ordered:
        picked.extend(fill_order(group))
    return Choice(tuple(picked[:gpus]), TIER_SPAN)


def choose_slots(slots: Iterable[SlotView], count: int, numa_capacity: int | None = None) -> list[SlotView] | None:
    choice = choose(slots, count, numa_capacity)
    return list(choice.slots) if choice else None


def summarize(
    node_id: str, free: Iterable[SlotView], total_slots: int, live_claims: int, numa_capacity: int
) -> NodeCandidate:
    """The capacity summary the adapter stores on the node row, from its eligible free slots."""
    usable = dedupe_fabric(free)
    if partitioned(usable):
        return _partition_summary(node_id, usable, total_slots, live_claims, numa_capacity)
    switch = [len(g) for k, g in _groups(usable, _switch_key).items() if k[0] != "solo" and k[0] is not None]
    numa = sorted((len(g) for k, g in _groups(usable, lambda s: s.numa_node).items() if k is not None), reverse=True)
    return NodeCandidate(
        node_id, len(usable), total_slots, live_claims, max(switch, default=0), tuple(numa), numa_capacity
    )


def _largest(partitions: Iterable[nvl.Partition], at_most: int) -> int:
    return max((p.size for p in partitions if p.size <= at_most), default=0)


def _partition_summary(
    node_id: str, usable: Sequence[SlotView], total_slots: int, live_claims: int, numa_capacity: int
) -> NodeCandidate:
    """The summary of a partitioned host in the terms the tiers read (see the module docstring): a 2-GPU
    request finds it at the switch tier only with a free pair, a 4-GPU one at the NUMA tier only with a free
    half, an 8-GPU one only with every GPU free."""
    modules = _by_module(usable)
    avail = nvl.available_partitions({mid: nvl.GpuState() for mid in modules})
    halves = sorted(
        (_largest((p for p in avail if p.modules <= half.modules), 4) for half in nvl.PARTITIONS if half.size == 4),
        reverse=True,
    )
    # A half is the host's NUMA-sized group whatever its slots' NUMA nodes say, so an 8-GPU slice spans two.
    return NodeCandidate(
        node_id, len(modules), total_slots, live_claims, _largest(avail, 2), tuple(h for h in halves if h), HALF
    )


# --- filters --------------------------------------------------------------------------------------


def best_tier(node: NodeCandidate, gpus: int) -> int | None:
    """The tier `choose` would reach on this node, from its summary alone; None if not topology-safe."""
    if node.free_slots < gpus:
        return None
    if gpus == 1:
        return TIER_SWITCH
    if node.max_switch_free >= gpus:
        return TIER_SWITCH
    span = numa_span_needed(gpus, node.numa_capacity)
    if span == 1:
        return TIER_NUMA if node.max_numa_free >= gpus else None
    return TIER_SPAN if sum(node.numa_free[:span]) >= gpus else None


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


# A slice-capable host handed out whole is a host of the baremetal offer: one machine, two offers (slice
# SKU -> whole-host SKU). Its mode, not its SKU, decides which one it serves at a time (domain/host_mode.py).
WHOLE_HOST_SKU: dict[str, str] = {"h200-sxm-slice": "h200-sxm"}


def node_skus(req: Request) -> tuple[str, ...]:
    """The node SKUs that may serve the request: its own, and for baremetal the slice SKUs of that host."""
    if req.shape != "baremetal":
        return (req.sku,)
    return (req.sku, *sorted(s for s, whole in WHOLE_HOST_SKU.items() if whole == req.sku))


# --- node rules -----------------------------------------------------------------------------------
#
# Every filter is a named rule, in the style of the Kubernetes scheduler's Filter plugins: a name (the node's
# bucket in the why-not answer's `filtered`), one explanation an operator reads ("3 nodes in maintenance"), and
# one predicate on the node's facts and the request. A shape's rules are tried in order and the first that
# fails names the node's bucket, so the order is the contract.
#
# Placement checks the same rules in SQL when it looks for and locks a node: adapters/inventory/node_rules_sql.py
# maps every rule *name* to one predicate, importing it fails if the names differ, and
# tests/integration/test_scheduler_node_rules.py evaluates every rule both ways on the same nodes. Placement
# and the why-not answer therefore read one definition, as slot eligibility does (domain/slots.py).


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


def _free_slots_short(node: NodeFacts, req: Request) -> bool:
    return node.candidate.free_slots < req.gpus


def _free_but_for_drift(node: NodeFacts, req: Request) -> bool:
    """Enough slots but for those with open drift on them: the answer ops can act on."""
    return _free_slots_short(node, req) and node.candidate.free_slots + node.drifted_free_slots >= req.gpus


def _partition_free(node: NodeFacts, req: Request) -> bool:
    """A host placed on NVLink partitions has a free partition of the request's size (one that exists)."""
    return req.gpus in nvl.SIZES and bool(nvl.feasible_partitions(node.gpu_states(), req.gpus))


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
    NodeRule("host_mode", _MODE, lambda n, r: n.mode == "slice"),
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
    NodeRule("host_mode", _MODE, lambda n, r: n.mode == "baremetal"),
    # A slot promises its GPU and disk to slices; a baremetal tenant owns them all.
    NodeRule("approved_slots", "still holding approved slots", lambda n, r: not n.approved_slots),
    _MAINTENANCE,
    _DRAINING,
    _NOT_READY,
    # The commissioning preflight gates slice capability only: a whole host needs no VFIO firmware.
    NodeRule("in_use", _HELD, lambda n, r: not n.live_claims),
)


def rules_for(shape: str) -> tuple[NodeRule, ...]:
    return BAREMETAL_RULES if shape == "baremetal" else SLICE_RULES


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


_BUCKETS = _one_per_name(SLICE_RULES, BAREMETAL_RULES)
# The buckets of the rules that judge the node rather than its current occupancy: a node passing them is
# "eligible" and its free GPUs count in the why-not answer.
NODE_LEVEL = frozenset(bucket for bucket, rule in _BUCKETS.items() if rule.node_level)


# --- scores ---------------------------------------------------------------------------------------


def score_sliced(node: NodeCandidate, gpus: int) -> int:
    return 0 if node.sliced else 1


def score_topology(node: NodeCandidate, gpus: int) -> int:
    tier = best_tier(node, gpus)
    return TIER_SPAN + 1 if tier is None else tier


def score_fit(node: NodeCandidate, gpus: int) -> int:
    return node.free_slots - gpus


SCORERS = (score_sliced, score_topology, score_fit)


def node_score(node: NodeCandidate, gpus: int) -> tuple[int | str, ...]:
    """Lower sorts first."""
    return (*(f(node, gpus) for f in SCORERS), node.node_id)


def rank_nodes(candidates: Iterable[NodeCandidate], gpus: int) -> list[NodeCandidate]:
    return sorted((c for c in candidates if best_tier(c, gpus) is not None), key=lambda c: node_score(c, gpus))


def rank_classes(
    gpus: int, max_switch_slots: int | None = None, max_numa_slots: int | None = None, min_numa_slots: int | None = None
) -> list[tuple[bool, int]]:
    """(sliced, tier) classes in score order; inside a class the order is (free slots, node id),
    which an index on (region, sku, sliced DESC, free_slots, node_id) yields without sorting.

    Given the fleet's largest switch and NUMA groups, tiers no host can reach are left out, so a
    4-GPU request never scans the index for a switch that holds 4 GPUs."""
    tiers = [TIER_SWITCH] if gpus == 1 else [TIER_SWITCH, TIER_NUMA, TIER_SPAN]
    if gpus > 1 and max_switch_slots is not None and gpus > max_switch_slots:
        tiers.remove(TIER_SWITCH)
    if gpus > 1 and max_numa_slots is not None and gpus > max_numa_slots:
        tiers.remove(TIER_NUMA)
    if gpus > 1 and min_numa_slots is not None and gpus <= min_numa_slots:
        tiers.remove(TIER_SPAN)  # on every host a group that fits one NUMA node must stay on one
    return [(sliced, tier) for sliced in (True, False) for tier in tiers]


def clean_node_allowed(clean_nodes: int, watermark: int) -> bool:
    """Slicing a clean host is allowed only while more than `watermark` clean hosts would remain."""
    return clean_nodes > watermark


# --- why not --------------------------------------------------------------------------------------


# What each bucket of `filtered` says: the rules' explanations, and the watermark's, a policy and not a rule.
_FILTER_TEXT = {
    **{bucket: rule.explanation for bucket, rule in _BUCKETS.items()},
    "clean_node_reserve": "reserved clean for baremetal",
}


def _filtered_text(filtered: Counter[str]) -> str:
    parts = [f"{n} {_FILTER_TEXT.get(k, k)}" for k, n in sorted(filtered.items(), key=lambda kv: (-kv[1], kv[0])) if n]
    return "; ".join(parts)


def unschedulable_summary(
    filtered: Counter[str],
    free_gpus: int,
    requested: int,
    shape: str = "gpu_slice",
    eligible_nodes: int | None = None,
    largest_free: int = 0,
) -> tuple[str, str]:
    """A reason code and a sentence an operator can act on."""
    detail = _filtered_text(filtered)
    suffix = f" (nodes: {detail})" if detail else ""
    if eligible_nodes == 0:
        noun = "baremetal host" if shape == "baremetal" else "slice host"
        return "no_eligible_node", f"no {noun} is eligible{suffix}"
    if shape == "baremetal":
        return "no_capacity", f"no clean baremetal-capable host is free{suffix}"
    if free_gpus == 0:
        return "no_capacity", f"no GPU is free on the eligible hosts; {requested} requested{suffix}"
    if free_gpus < requested:
        return "insufficient_capacity", f"{free_gpus} GPUs free, {requested} requested{suffix}"
    if filtered.get("hugepages_insufficient"):
        return "hugepages_insufficient", (
            f"{free_gpus} GPUs free but the hosts that fit {requested} lack the free 1 GiB hugepages their slot "
            f"profile needs{suffix}"
        )
    if filtered.get("topology"):
        return "topology", f"{free_gpus} GPUs free but no node has {requested} topology-safe slots{suffix}"
    if filtered.get("nvlink_partition"):
        return "no_partition", f"{free_gpus} GPUs free but no host has a free {requested}-GPU NVLink partition{suffix}"
    if filtered.get("clean_node_reserve"):
        return "clean_node_reserve", (
            f"{free_gpus} GPUs free but the hosts that fit {requested} are clean hosts kept for baremetal{suffix}"
        )
    return "fragmented", (
        f"{free_gpus} GPUs free but no node has {requested} free slots (largest: {largest_free}){suffix}"
    )


def fabric_manager_note(nodes: Iterable[NodeFacts], driver_version: str | None) -> str:
    """Which Fabric Manager versions the `fabric_manager_version` nodes run, against the image's driver."""
    found = Counter(n.fabric_manager_version or "not reported" for n in nodes)
    if not found or driver_version is None:
        return ""
    hosts = ", ".join(f"{v} ({k})" for v, k in sorted(found.items()))
    return f"; the image's driver is {driver_version}, their Fabric Manager: {hosts}"


def partition_summary(nodes: Iterable[NodeFacts], requested: int, detail: Counter[str]) -> tuple[str, str] | None:
    """The why-not answer in partition terms (domain/nvlink_partitions.py's `why_not`) when every eligible host
    with a free GPU is placed on partitions and their partitions are what is missing; else None."""
    hosts = {n.node_id: n.gpu_states() for n in nodes}
    answer = nvl.why_not(hosts, requested) if hosts else None
    if answer is None or answer[0] not in ("no_partition", "unsupported_size"):
        return None
    text = _filtered_text(detail)
    return answer[0], answer[1] + (f" (nodes: {text})" if text else "")


def image_gate(slug: str, digest: str, reported: bool) -> tuple[str, str] | None:
    """(slug, digest) when slice placement must require a verified cache of this image, else None.

    The rule: the gate applies to an image once any `image.node_cache_changed` for its slug has
    reached the scheduler. Images that predate the prewarm pipeline (the dev stack's seed images,
    copied into each host's cache by the fleet) are never reported, so they stay placeable as before.
    For a prewarmed image the rule is safe even before its reports arrive: the image pipeline
    activates an image only once every known slice host verified the catalog digest, so an
    allocation for it cannot be accepted while a host lacks it; the reports then keep placement
    honest afterwards (a host that loses the cache, a mismatch, a new digest, a host added later).

    `reported`: whether any report for the slug has arrived (read by `prelude`, in the request's first query).
    """
    return (slug, digest) if reported else None
