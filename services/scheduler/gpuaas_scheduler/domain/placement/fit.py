"""The fit: which slots of one host a slice takes, what a host offers, and how hosts rank.

Scorers order the nodes that pass the node rules (rules.py). The order is lexicographic over the scorers
in `SCORERS` and ends on the node id, so the same inventory and the same request always give the
same choice:

1. `score_sliced`   — already-sliced hosts first: clean hosts stay whole for baremetal and 8-GPU slices.
2. `score_topology` — the tightest topology the node can offer for the request: one PCIe switch (0),
                      one NUMA node (1), the fewest NUMA nodes the request can span (2).
3. `score_fit`      — best fit: the fewest free slots left over on the node.
4. node id.

A group is *topology-safe* when it spans no more NUMA nodes than the request needs
(ceil(gpus / slots per NUMA node on that host)); slots of unknown NUMA node never join a multi-GPU
group. A hard rule, so a 4-GPU VM never straddles the inter-socket link when the host could keep
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

The search ends on `pick_slots`: the group chosen on the locked host and the host's summary once it is taken,
one value (`SlotPick`) for whatever records the claim.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from .. import nvlink_partitions as nvl

TIER_SWITCH, TIER_NUMA, TIER_SPAN = 0, 1, 2
TIER_NAMES = {TIER_SWITCH: "one PCIe switch", TIER_NUMA: "one NUMA node", TIER_SPAN: "minimal NUMA span"}


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


def _numa_key(slot: SlotView) -> int | None:
    return slot.numa_node


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


# --- choice ---------------------------------------------------------------------------------------


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


@dataclass(frozen=True)
class _Layout:
    """One host's usable free slots grouped by PCIe switch and by NUMA node: what `choose` reads at each level
    of the hierarchy, best fit bottom-up."""

    free: list[SlotView]
    numa_capacity: int
    by_switch: dict[tuple[object, object], list[SlotView]]
    by_numa: dict[int | None, list[SlotView]]

    @classmethod
    def of(cls, free: list[SlotView], numa_capacity: int | None) -> _Layout:
        by_numa = _groups(free, _numa_key)
        if numa_capacity is None:
            numa_capacity = max((len(g) for k, g in by_numa.items() if k is not None), default=0)
        return cls(free, numa_capacity, _groups(free, _switch_key), by_numa)

    def switch_free(self, slot: SlotView) -> int:
        return len(self.by_switch[_switch_key(slot)])

    def numa_free(self, numa_node: int | None) -> int:
        return len(self.by_numa[numa_node])

    def fill_order(self, pool: Iterable[SlotView]) -> list[SlotView]:
        # Inside a container take broken switches first, so intact pairs survive.
        return sorted(pool, key=lambda s: (self.switch_free(s), str(_switch_key(s)), s.slot_id))

    def single(self) -> Choice:
        """One GPU: the slot that breaks the smallest switch group, then the smallest NUMA node."""
        best = min(
            self.free,
            key=lambda s: (
                self.switch_free(s),
                self.numa_free(s.numa_node) if s.numa_node is not None else 0,
                s.slot_id,
            ),
        )
        return Choice((best,), TIER_SWITCH)

    def one_switch(self, gpus: int) -> Choice | None:
        """The smallest known PCIe-switch group that holds them all."""
        switches = [g for k, g in self.by_switch.items() if k[0] != "solo" and k[0] is not None and len(g) >= gpus]
        if not switches:
            return None
        group = min(switches, key=lambda g: (len(g), self.numa_free(g[0].numa_node), g[0].slot_id))
        return Choice(tuple(sorted(group, key=lambda s: s.slot_id)[:gpus]), TIER_SWITCH)

    def one_numa(self, gpus: int) -> Choice | None:
        """The smallest NUMA node that holds them all."""
        fitting = [g for k, g in self.by_numa.items() if k is not None and len(g) >= gpus]
        if not fitting:
            return None
        group = min(fitting, key=lambda g: (len(g), g[0].numa_node))
        return Choice(tuple(self.fill_order(group)[:gpus]), TIER_NUMA)

    def numa_span(self, gpus: int, span: int) -> Choice | None:
        """The `span` fullest NUMA nodes, when together they hold them all."""
        numas = sorted(((k, g) for k, g in self.by_numa.items() if k is not None), key=lambda kv: (-len(kv[1]), kv[0]))
        ordered = [g for _, g in numas[:span]]
        known = sum(len(g) for _, g in numas)
        if sum(len(g) for g in ordered) < gpus or known < gpus:
            return None
        picked = [slot for group in ordered for slot in self.fill_order(group)]
        return Choice(tuple(picked[:gpus]), TIER_SPAN)


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
    layout = _Layout.of(free, numa_capacity)
    if gpus == 1:
        return layout.single()
    switch = layout.one_switch(gpus)
    if switch is not None:
        return switch
    span = numa_span_needed(gpus, layout.numa_capacity)
    return layout.one_numa(gpus) if span == 1 else layout.numa_span(gpus, span)


def choose_slots(slots: Iterable[SlotView], count: int, numa_capacity: int | None = None) -> list[SlotView] | None:
    choice = choose(slots, count, numa_capacity)
    return list(choice.slots) if choice else None


@dataclass(frozen=True)
class SlotPick:
    """The search's final choice on one locked host: the group a slice takes there and the host's capacity
    summary once it holds it. One value for whatever records the claim: the slot claims today
    (`inventory.claim_slots`), a Host aggregate's `reserve` once the host owns its claims."""

    node_id: str
    choice: Choice
    after: NodeCandidate

    @property
    def slots(self) -> tuple[SlotView, ...]:
        return self.choice.slots


def pick_slots(
    node_id: str, free: Sequence[SlotView], gpus: int, total_slots: int, numa_capacity: int
) -> SlotPick | None:
    """The best group of a locked host's free slots for `gpus` (`choose`), or None when it has none."""
    choice = choose(free, gpus, numa_capacity)
    if choice is None:
        return None
    chosen = {s.slot_id for s in choice.slots}
    rest = [s for s in free if s.slot_id not in chosen]
    # The host holds at least this claim now, so its summary is a sliced host's whatever it held before.
    return SlotPick(node_id, choice, summarize(node_id, rest, total_slots, 1, numa_capacity))


# --- capacity summary -----------------------------------------------------------------------------


def summarize(
    node_id: str, free: Iterable[SlotView], total_slots: int, live_claims: int, numa_capacity: int
) -> NodeCandidate:
    """The capacity summary the adapter stores on the node row, from its eligible free slots."""
    usable = dedupe_fabric(free)
    if partitioned(usable):
        return _partition_summary(node_id, usable, total_slots, live_claims, numa_capacity)
    switch = [len(g) for k, g in _groups(usable, _switch_key).items() if k[0] != "solo" and k[0] is not None]
    numa = sorted((len(g) for k, g in _groups(usable, _numa_key).items() if k is not None), reverse=True)
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
    tiers = [TIER_SWITCH] if gpus == 1 else _reachable_tiers(gpus, max_switch_slots, max_numa_slots, min_numa_slots)
    return [(sliced, tier) for sliced in (True, False) for tier in tiers]


def _reachable_tiers(
    gpus: int, max_switch_slots: int | None, max_numa_slots: int | None, min_numa_slots: int | None
) -> list[int]:
    """The tiers a multi-GPU group can reach on some host of the fleet; a request of no GPUs (no host takes one)
    keeps them all."""
    if gpus < 1:
        return [TIER_SWITCH, TIER_NUMA, TIER_SPAN]
    out_of_reach = {
        TIER_SWITCH: max_switch_slots is not None and gpus > max_switch_slots,
        TIER_NUMA: max_numa_slots is not None and gpus > max_numa_slots,
        # On every host a group that fits one NUMA node must stay on one.
        TIER_SPAN: min_numa_slots is not None and gpus <= min_numa_slots,
    }
    return [tier for tier in (TIER_SWITCH, TIER_NUMA, TIER_SPAN) if not out_of_reach[tier]]


def clean_node_allowed(clean_nodes: int, watermark: int) -> bool:
    """Slicing a clean host is allowed only while more than `watermark` clean hosts would remain."""
    return clean_nodes > watermark
