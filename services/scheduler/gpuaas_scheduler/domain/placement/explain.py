"""The why-not answer's words: a reason code and one sentence an operator can act on, from the buckets the
node rules (rules.py) put the fleet's nodes in, and the notes that name what an operator would change."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from gpuaas_common.contract import Shape

from .. import nvlink_partitions as nvl
from .rules import BUCKETS, NodeFacts

HUGEPAGE_FILTERS = ("hugepages_missing", "hugepages_insufficient")

# What each bucket of `filtered` says: the rules' explanations, and the watermark's, a policy and not a rule.
_FILTER_TEXT = {
    **{bucket: rule.explanation for bucket, rule in BUCKETS.items()},
    "clean_node_reserve": "reserved clean for baremetal",
}

# When enough GPUs are free yet none was placed: the first bucket here that holds a node says why, with its
# reason code and sentence ({free}: GPUs free on the eligible hosts, {requested}: GPUs asked).
_FREE_BUT: tuple[tuple[str, str, str], ...] = (
    (
        "hugepages_insufficient",
        "hugepages_insufficient",
        "{free} GPUs free but the hosts that fit {requested} lack the free 1 GiB hugepages their slot profile needs",
    ),
    ("topology", "topology", "{free} GPUs free but no node has {requested} topology-safe slots"),
    ("nvlink_partition", "no_partition", "{free} GPUs free but no host has a free {requested}-GPU NVLink partition"),
    (
        "clean_node_reserve",
        "clean_node_reserve",
        "{free} GPUs free but the hosts that fit {requested} are clean hosts kept for baremetal",
    ),
)


def _filtered_text(filtered: Counter[str]) -> str:
    parts = [f"{n} {_FILTER_TEXT.get(k, k)}" for k, n in sorted(filtered.items(), key=lambda kv: (-kv[1], kv[0])) if n]
    return "; ".join(parts)


def _nodes_suffix(filtered: Counter[str]) -> str:
    detail = _filtered_text(filtered)
    return f" (nodes: {detail})" if detail else ""


def unschedulable_summary(
    filtered: Counter[str],
    free_gpus: int,
    requested: int,
    shape: str = Shape.GPU_SLICE,
    eligible_nodes: int | None = None,
    largest_free: int = 0,
) -> tuple[str, str]:
    """A reason code and a sentence an operator can act on."""
    code, sentence = _reason(filtered, free_gpus, requested, shape, eligible_nodes, largest_free)
    return code, sentence + _nodes_suffix(filtered)


def _reason(
    filtered: Counter[str], free_gpus: int, requested: int, shape: str, eligible_nodes: int | None, largest_free: int
) -> tuple[str, str]:
    if eligible_nodes == 0:
        noun = "baremetal host" if shape == Shape.BAREMETAL else "slice host"
        return "no_eligible_node", f"no {noun} is eligible"
    if shape == Shape.BAREMETAL:
        return "no_capacity", "no clean baremetal-capable host is free"
    if free_gpus == 0:
        return "no_capacity", f"no GPU is free on the eligible hosts; {requested} requested"
    if free_gpus < requested:
        return "insufficient_capacity", f"{free_gpus} GPUs free, {requested} requested"
    for bucket, code, sentence in _FREE_BUT:
        if filtered.get(bucket):
            return code, sentence.format(free=free_gpus, requested=requested)
    return "fragmented", f"{free_gpus} GPUs free but no node has {requested} free slots (largest: {largest_free})"


def partition_summary(nodes: Iterable[NodeFacts], requested: int, detail: Counter[str]) -> tuple[str, str] | None:
    """The why-not answer in partition terms (domain/nvlink_partitions.py's `why_not`) when every eligible host
    with a free GPU is placed on partitions and their partitions are what is missing; else None."""
    hosts = {n.node_id: n.gpu_states() for n in nodes}
    answer = nvl.why_not(hosts, requested) if hosts else None
    if answer is None or answer[0] not in ("no_partition", "unsupported_size"):
        return None
    return answer[0], answer[1] + _nodes_suffix(detail)


def hugepage_note(nodes: Iterable[NodeFacts], per_gpu: dict[str, int]) -> str:
    """Which runtime profiles asked the hugepages the `HUGEPAGE_FILTERS` nodes lack: an operator can then give
    the hosts pages or approve their slots with a plain profile. Empty when no profile asked."""
    names = sorted({p for n in nodes for p in n.hugepage_profiles})
    if not names:
        return ""
    return "; 1 GiB hugepages asked by " + ", ".join(f"profile {p} ({per_gpu.get(p, 0)} per GPU)" for p in names)


def fabric_manager_note(nodes: Iterable[NodeFacts], driver_version: str | None) -> str:
    """Which Fabric Manager versions the `fabric_manager_version` nodes run, against the image's driver."""
    found = Counter(n.fabric_manager_version or "not reported" for n in nodes)
    if not found or driver_version is None:
        return ""
    hosts = ", ".join(f"{v} ({k})" for v, k in sorted(found.items()))
    return f"; the image's driver is {driver_version}, their Fabric Manager: {hosts}"
