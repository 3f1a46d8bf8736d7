"""Placement on NVLink partitions (issue 29, point 2) as the scheduler's placement domain applies it: a host whose
slots carry module IDs gives each slice exactly one Fabric Manager partition, in buddy order; its capacity summary
ranks it by free partitions; why-not speaks in partitions; approval keeps the module map consistent. A host
without module IDs keeps the PCIe-switch and NUMA rules."""

from __future__ import annotations

from collections import Counter

import pytest

from gpuaas_scheduler.domain import nvlink_partitions as nvl
from gpuaas_scheduler.domain.approval import module_problems
from gpuaas_scheduler.domain.placement import (
    TIER_NUMA,
    TIER_SPAN,
    TIER_SWITCH,
    NodeCandidate,
    NodeFacts,
    Request,
    SlotView,
    best_tier,
    choose,
    fabric_manager_mismatch,
    node_filter,
    partition_summary,
    summarize,
)

# The one real system of the partitions reference: bus -> module ID; neighbouring buses share a PCIe switch.
REAL_BOARD = {"0f": 5, "10": 7, "41": 6, "44": 8, "86": 1, "87": 3, "b8": 2, "bb": 4}


def board(free_modules=None, *, with_modules=True) -> list[SlotView]:
    slots = []
    for i, (bus, module) in enumerate(REAL_BOARD.items()):
        if free_modules is not None and module not in free_modules:
            continue
        slots.append(
            SlotView(
                f"s-{bus}",
                0 if module <= 4 else 1,
                f"sw{i // 2}",
                f"0000:29:00.{i}",
                module if with_modules else None,
            )
        )
    return slots


def modules_of(choice) -> frozenset[int]:
    return frozenset(s.module_id for s in choice.slots)


@pytest.mark.parametrize(
    "free, gpus, modules, partition",
    [
        # A clean board: the first pair of the first half (lowest partition id on a tie).
        (set(range(1, 9)), 2, {1, 3}, 3),
        (set(range(1, 9)), 4, {1, 2, 3, 4}, 1),
        (set(range(1, 9)), 8, set(range(1, 9)), 0),
        # A broken pair's mate before a whole pair: module 1 taken leaves 3 alone.
        ({2, 3, 4, 5, 6, 7, 8}, 1, {3}, 9),
        # {1, 2} is free and on one socket but no partition: the pair is {2, 4} once 3 is gone.
        ({1, 2, 4, 5, 6, 7, 8}, 2, {2, 4}, 4),
        # Only {1, 2} free in the first half and nothing else: no 2-GPU slice at all.
        ({1, 2}, 2, None, None),
        # The tenanted half before the empty one for a pair.
        ({1, 3, 5, 6, 7, 8}, 2, {1, 3}, 3),
        # A half needs all four; 3 GPUs is no partition size.
        ({1, 2, 3, 5, 6, 7}, 4, None, None),
        (set(range(1, 9)), 3, None, None),
        # An 8-GPU slice needs every GPU.
        ({1, 2, 3, 4, 5, 6, 7}, 8, None, None),
    ],
)
def test_a_slice_takes_exactly_one_partition_in_buddy_order(free, gpus, modules, partition) -> None:
    choice = choose(board(free), gpus, 4)
    if modules is None:
        assert choice is None
        return
    assert choice is not None
    assert modules_of(choice) == frozenset(modules) and choice.partition == partition
    assert nvl.partition_for(modules_of(choice)) is nvl.BY_ID[partition]


def test_no_sequence_of_pair_placements_ever_yields_an_invalid_pair() -> None:
    free = set(range(1, 9))
    taken = []
    while (choice := choose(board(free), 2, 4)) is not None:
        taken.append(modules_of(choice))
        free -= modules_of(choice)
    assert sorted(map(sorted, taken)) == [[1, 3], [2, 4], [5, 7], [6, 8]]


def test_a_degraded_gpu_removes_every_partition_holding_it() -> None:
    # Module 5 is not among the free slots (unhealthy, disabled or drifted slots never are).
    free = set(range(1, 9)) - {5}
    assert choose(board(free), 8, 4) is None
    assert modules_of(choose(board(free), 4, 4)) == {1, 2, 3, 4}
    pairs = []
    while (choice := choose(board(free), 2, 4)) is not None:
        pairs.append(modules_of(choice))
        free -= modules_of(choice)
    assert {5, 7} not in pairs and len(pairs) == 3


def test_a_module_two_free_slots_claim_is_used_by_neither() -> None:
    slots = board() + [SlotView("s-twin", 0, "sw9", "0000:29:01.0", 1)]
    assert 1 not in modules_of(choose(slots, 4, 4) or choose(slots, 2, 4))
    assert choose(slots, 8, 4) is None


def test_a_host_without_module_ids_keeps_the_switch_and_numa_rules() -> None:
    legacy = board(with_modules=False)
    choice = choose(legacy, 2, 4)
    assert choice is not None and choice.partition is None and choice.tier == TIER_SWITCH
    # Without module IDs a 3-GPU group on one NUMA node is topology-safe, as before.
    assert choose(legacy, 3, 4) is not None


@pytest.mark.parametrize(
    "free, tiers",
    [
        # gpus: 1, 2, 4, 8
        (set(range(1, 9)), [TIER_SWITCH, TIER_SWITCH, TIER_NUMA, TIER_SPAN]),
        # A free pair but no free half.
        ({1, 3, 5, 7}, [TIER_SWITCH, TIER_SWITCH, None, None]),
        # Four GPUs free, one in each pair: no 2-GPU partition although 4 GPUs are free on one socket.
        ({1, 2, 5, 6}, [TIER_SWITCH, None, None, None]),
        ({5, 6, 7, 8}, [TIER_SWITCH, TIER_SWITCH, TIER_NUMA, None]),
    ],
)
def test_the_summary_ranks_a_partitioned_host_by_its_free_partitions(free, tiers) -> None:
    summary = summarize("h", board(free), 8, 1, 4)
    assert summary.free_slots == len(free)
    assert [best_tier(summary, g) for g in (1, 2, 4, 8)] == tiers


def _facts(states: dict[int, str], node_id: str = "h") -> NodeFacts:
    return NodeFacts(
        node_id,
        "default",
        "h200-sxm-slice",
        True,
        False,
        "slice",
        True,
        False,
        False,
        0,
        1,
        False,
        summarize(node_id, board({m for m, s in states.items() if s == "free"}), 8, 1, 4),
        preflight_status="passed",
        module_states=tuple(sorted(states.items())),
    )


def test_why_not_speaks_in_partitions() -> None:
    # One tenant on module 1 and one on module 5: GPUs free on both halves, no half free.
    hosts = [_facts({m: "held" if m in (1, 5) else "free" for m in range(1, 9)}, f"h{i}") for i in range(2)]
    req = Request("gpu_slice", 4, "default", "h200-sxm-slice")
    assert {node_filter(h, req) for h in hosts} == {"nvlink_partition"}
    code, text = partition_summary(hosts, 4, Counter({"nvlink_partition": 2}))
    assert code == "no_partition"
    assert text.startswith("12 GPUs free, no free 4-GPU partition: every half has a tenant")
    # A degraded GPU in one half and a tenant in the other.
    sick = [_facts({m: "sick" if m == 2 else "held" if m == 6 else "free" for m in range(1, 9)})]
    assert partition_summary(sick, 4, Counter())[1].endswith("1 half has a tenant, 1 a degraded or excluded GPU")
    assert partition_summary(sick, 3, Counter())[0] == "unsupported_size"
    # A 2-GPU request fits: no answer in partition terms is made up.
    assert partition_summary(hosts, 2, Counter()) is None
    assert node_filter(hosts[0], Request("gpu_slice", 2, "default", "h200-sxm-slice")) is None


def test_a_host_without_module_ids_is_never_judged_by_partitions() -> None:
    legacy = NodeFacts(
        "l", "default", "h200-sxm-slice", True, False, "slice", True, False, False, 0, 0, False,
        NodeCandidate("l", 3, 8, 1, 1, (3,), 4), preflight_status="passed",
    )  # fmt: skip
    assert node_filter(legacy, Request("gpu_slice", 3, "default", "h200-sxm-slice")) is None


def _gpu(addr: str, module: int | None, **more) -> dict:
    return {"gpu_pci_address": addr, "module_id": module, **more}


@pytest.mark.parametrize(
    "candidate, peers, problems",
    [
        # Every GPU mapped, each module once: approvable.
        (_gpu("a", 1), [_gpu("b", 3), _gpu("c", 2)], []),
        # No GPU of the node mapped (older evidence): approvable, placed without partitions.
        (_gpu("a", None), [_gpu("b", None)], []),
        # An emulated slot has no GPU to map.
        ({"emulated": True, "module_id": None}, [_gpu("b", 3)], []),
        (_gpu("a", None), [_gpu("b", 3)], ["GPU has no module ID while 1 other GPUs of the node have one"]),
        (_gpu("a", 1), [_gpu("b", None)], ["GPUs of the node without a module ID: b"]),
        (_gpu("a", 1), [_gpu("b", 1), _gpu("c", 2)], ["module ID 1 also reported for GPU b"]),
        (_gpu("a", 9), [], ["module ID 9 is not one of 1-8"]),
        # The candidate itself among the peers (a batch approval) is not its own twin.
        (_gpu("a", 1), [_gpu("a", 1), _gpu("b", 3)], []),
    ],
)
def test_approval_requires_a_consistent_module_map(candidate, peers, problems) -> None:
    found = module_problems(candidate, peers)
    assert len(found) == len(problems)
    for got, want in zip(found, problems, strict=True):
        assert got.startswith(want)


@pytest.mark.parametrize(
    "driver, fabric_manager, partitioned, bucket",
    [
        ("580.159.04", "580.159.04", True, None),
        ("580.159.04", "550.127.05", True, "fabric_manager_version"),
        ("580.159.04", None, True, "fabric_manager_version"),
        # An image that names no driver is not gated; a host without partitions activates none.
        (None, "550.127.05", True, None),
        ("580.159.04", "550.127.05", False, None),
    ],
)
def test_the_fabric_manager_version_must_equal_the_guest_driver(driver, fabric_manager, partitioned, bucket) -> None:
    facts = _facts({m: "free" for m in range(1, 9)})
    facts = NodeFacts(
        **{
            **facts.__dict__,
            "fabric_manager_version": fabric_manager,
            "module_states": facts.module_states if partitioned else (),
        }
    )
    req = Request("gpu_slice", 2, "default", "h200-sxm-slice", driver_version=driver)
    assert fabric_manager_mismatch(facts, req) is (bucket is not None)
    assert node_filter(facts, req) == bucket
