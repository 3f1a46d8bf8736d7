"""1 GiB hugepages in placement: which runtime profiles need them (the table the agent and the scheduler
share), and the pure filters that keep a slice of such a profile off a host that cannot back it."""

from __future__ import annotations

from collections import Counter

import pytest

from gpuaas_common.profiles import hugepage_profiles, hugepages_1g_needed, runtime_profile
from gpuaas_node_agent.domain.profiles import vm_resources
from gpuaas_scheduler.domain.placement import (
    NODE_LEVEL,
    NodeFacts,
    Request,
    SlotView,
    hugepages_insufficient,
    hugepages_missing,
    node_filter,
    summarize,
    unschedulable_summary,
)

TUNED = "h200_1g_24c_64g"


# --- the shared profile table -------------------------------------------------------------------------


def test_only_the_tuned_profile_needs_hugepages() -> None:
    assert hugepage_profiles() == {TUNED: 64}
    for other in ("h200_1g_24c_48g", "h200_1g_16c_32g", "h200_2g_48c_128g"):
        assert runtime_profile(other).hugepages_1g_per_gpu == 0
        assert hugepages_1g_needed(other, 4) == 0


@pytest.mark.parametrize("gpus", [1, 2, 4, 8])
def test_the_scheduler_reserves_exactly_the_pages_the_agent_backs_the_vm_with(gpus: int) -> None:
    _, memory_mib, hugepages = vm_resources(TUNED, gpus)
    assert hugepages and hugepages_1g_needed(TUNED, gpus) == memory_mib // 1024 == 64 * gpus


def test_unknown_profiles_are_refused_by_both() -> None:
    for bad in ("a100_1g", "h200_0g_8c_16g"):
        with pytest.raises(ValueError):
            hugepages_1g_needed(bad, 1)


# --- the filters ----------------------------------------------------------------------------------------


def node(*, total: int | None, held: int = 0, per_gpu: int = 64, free_ids=range(8), **kw) -> NodeFacts:
    slots = [SlotView(f"s{i}", 0 if i < 4 else 1, f"sw{i // 2}", f"vf{i}") for i in free_ids]
    base = dict(
        node_id="n1",
        region="r1",
        sku="h200-sxm-slice",
        accepts_slices=True,
        accepts_baremetal=False,
        mode="slice",
        schedulable=True,
        draining=False,
        maintenance=False,
        parity_failures=0,
        live_claims=8 - len(slots),
        exclusive_held=False,
        candidate=summarize("n1", slots, 8, 8 - len(slots), 4),
        preflight_status="passed",
        hugepages_1g_total=total,
        hugepages_1g_held=held,
        hugepages_1g_per_gpu=per_gpu,
    )
    base.update(kw)
    return NodeFacts(**base)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("facts", "gpus", "bucket"),
    [
        # The violating fixtures: a host that never reported hugepages, or has none, took the tuned profile.
        (node(total=None), 1, "hugepages_missing"),
        (node(total=0), 1, "hugepages_missing"),
        # Fewer pages than the request needs even with nothing running.
        (node(total=128), 4, "hugepages_missing"),
        (node(total=128), 2, None),
        (node(total=512), 8, None),
        # Enough configured, but the slices it runs hold them.
        (node(total=256, held=192, free_ids=range(5)), 2, "hugepages_insufficient"),
        (node(total=256, held=192, free_ids=range(5)), 1, None),
        (node(total=512, held=448, free_ids=[7]), 1, None),
        # A profile that does not opt in needs no hugepage evidence at all.
        (node(total=None, per_gpu=0), 4, None),
        (node(total=0, per_gpu=0), 8, None),
        # Order: node-level evidence first, hugepages after the image gate and before occupancy...
        (node(total=None, parity_failures=2), 1, "parity"),
        (node(total=None, image_ready=False), 1, "image_cache"),
        (node(total=None, exclusive_held=True), 1, "hugepages_missing"),
        # ... and held pages after free slots: a host with too few slots is short of slots first.
        (node(total=256, held=192, free_ids=[0]), 2, "free_slot_count"),
        (node(total=512, held=256, free_ids=[0, 2, 4, 6]), 4, "topology"),
    ],
)
def test_hugepage_filters_name_their_bucket(facts: NodeFacts, gpus: int, bucket: str | None) -> None:
    assert node_filter(facts, Request("gpu_slice", gpus, "r1", "h200-sxm-slice")) == bucket


def test_the_two_filters_on_their_own() -> None:
    req = Request("gpu_slice", 2, "r1", "h200-sxm-slice")
    assert hugepages_missing(node(total=64), req) and not hugepages_insufficient(node(total=128), req)
    busy = node(total=128, held=128)
    assert not hugepages_missing(busy, req) and hugepages_insufficient(busy, req)


def test_baremetal_ignores_hugepages() -> None:
    bm = node(total=None, sku="h200-sxm", accepts_baremetal=True, accepts_slices=False, mode="baremetal")
    assert node_filter(bm, Request("baremetal", 8, "r1", "h200-sxm")) is None


def test_missing_is_a_node_verdict_and_held_pages_are_occupancy() -> None:
    assert "hugepages_missing" in NODE_LEVEL and "hugepages_insufficient" not in NODE_LEVEL


def test_why_not_texts_name_the_hugepages() -> None:
    code, reason = unschedulable_summary(Counter({"hugepages_missing": 3}), 0, 1, "gpu_slice", 0)
    assert code == "no_eligible_node"
    assert "3 without the 1 GiB hugepages their slot profile needs" in reason
    code, reason = unschedulable_summary(Counter({"hugepages_insufficient": 1, "in_use": 1}), 6, 2, "gpu_slice", 2, 5)
    assert code == "hugepages_insufficient"
    assert reason.startswith("6 GPUs free but the hosts that fit 2 lack the free 1 GiB hugepages")
    assert "1 whose free 1 GiB hugepages are held by running slices" in reason
