import importlib.util
import itertools
import random
import sys
from pathlib import Path

import pytest

from gpuaas_scheduler.domain.nvlink_partitions import (
    BY_ID,
    MODULE_IDS,
    PARTITIONS,
    GpuState,
    available_partitions,
    best_partition,
    best_placement,
    buddy_score,
    feasible_partitions,
    overlapping,
    partition_for,
    why_not,
)

FREE, HELD = GpuState(), GpuState(free=False)
DEGRADED, EXCLUDED = GpuState(healthy=False), GpuState(excluded=True)


def host(held=(), degraded=(), excluded=()):
    """A host by module ID; every GPU not named is free."""
    out = dict.fromkeys(MODULE_IDS, FREE)
    out.update(dict.fromkeys(held, HELD))
    out.update(dict.fromkeys(degraded, DEGRADED))
    out.update(dict.fromkeys(excluded, EXCLUDED))
    return out


def ids(partitions):
    return sorted(p.partition_id for p in partitions)


def modules(partition):
    return sorted(partition.modules) if partition else None


# --- the fifteen partitions -----------------------------------------------------------------------


def test_the_fifteen_partitions_of_the_reference():
    assert {pid: sorted(p.modules) for pid, p in BY_ID.items()} == {
        0: [1, 2, 3, 4, 5, 6, 7, 8],
        1: [1, 2, 3, 4],
        2: [5, 6, 7, 8],
        3: [1, 3],
        4: [2, 4],
        5: [5, 7],
        6: [6, 8],
        **{6 + m: [m] for m in MODULE_IDS},
    }


@pytest.mark.parametrize(
    ("mods", "pid"),
    [
        ({1, 3}, 3),
        ({8, 6}, 6),
        ({1, 2, 3, 4}, 1),
        (set(MODULE_IDS), 0),
        ({5}, 11),
        ({1, 2}, None),
        ({3, 4}, None),
        ({1, 5}, None),
        ({1, 2, 3}, None),
        ({1, 3, 5, 7}, None),
        (set(range(1, 8)), None),
        (set(), None),
    ],
)
def test_partition_for_accepts_only_the_supported_sets(mods, pid):
    got = partition_for(mods)
    assert (got.partition_id if got else None) == pid


def test_no_size_outside_one_two_four_eight():
    sizes = {p.size for p in PARTITIONS}
    assert sizes == {1, 2, 4, 8}
    for n in (0, 3, 5, 6, 7, 9):
        assert feasible_partitions(host(), n) == []


# --- feasibility ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("gpus", "count", "expected"),
    [
        (host(), 8, [0]),
        (host(), 4, [1, 2]),
        (host(), 2, [3, 4, 5, 6]),
        (host(held=[8]), 8, []),
        (host(held=[8]), 4, [1]),
        # 1 and 2 are free and on one socket, yet {1, 2} is no partition: no pair left in the first half.
        (host(held=[3, 4, 5, 6, 7, 8]), 2, []),
        (host(held=[3, 4, 5, 6, 7, 8]), 1, [7, 8]),
        (host(held=[1]), 2, [4, 5, 6]),
        (host(held=[1, 4, 5, 8]), 2, []),
        (host(held=list(MODULE_IDS)), 1, []),
    ],
)
def test_feasible_partitions(gpus, count, expected):
    assert ids(feasible_partitions(gpus, count)) == expected


@pytest.mark.parametrize("sick", [DEGRADED, EXCLUDED, GpuState(free=False, healthy=False)])
@pytest.mark.parametrize("module", MODULE_IDS)
def test_a_sick_gpu_removes_every_partition_that_contains_it(sick, module):
    gpus = host()
    gpus[module] = sick
    left = available_partitions(gpus)
    assert all(module not in p.modules for p in left)
    # ...and only those: the rest of the board stays placeable.
    assert ids(left) == ids(p for p in PARTITIONS if module not in p.modules)


def test_an_unreported_gpu_counts_as_unavailable():
    gpus = host()
    del gpus[6]
    assert ids(feasible_partitions(gpus, 2)) == [3, 4, 5]
    assert feasible_partitions(gpus, 8) == []


@pytest.mark.parametrize("held", [(), (1,), (8,), (1, 2, 3, 4)])
def test_eight_gpus_only_on_a_fully_free_healthy_host(held):
    assert (feasible_partitions(host(held=held), 8) != []) == (held == ())
    assert feasible_partitions(host(degraded=[4]), 8) == []


def test_the_invalid_pair_is_never_placed_on_any_occupancy():
    # Every one of the 256 occupancies of a board: a 2-GPU choice is always one of the four pairs.
    pairs = {frozenset({1, 3}), frozenset({2, 4}), frozenset({5, 7}), frozenset({6, 8})}
    for bits in itertools.product((FREE, HELD), repeat=8):
        gpus = dict(zip(MODULE_IDS, bits, strict=True))
        chosen = best_partition(gpus, 2)
        if chosen is not None:
            assert chosen.modules in pairs
            assert all(gpus[m].available for m in chosen.modules)
        free = {m for m, g in gpus.items() if g.available}
        assert (chosen is None) == all(not p <= free for p in pairs)


# --- buddy order ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("gpus", "count", "expected", "why"),
    [
        (host(held=[1]), 1, [3], "the free mate of a broken pair before any whole pair"),
        (host(held=[1, 3]), 1, [2], "a pair in the tenanted half before opening the empty half"),
        (host(held=[1, 3]), 2, [2, 4], "the pair left in the tenanted half"),
        (host(held=[5]), 2, [6, 8], "the tenanted half again, the other half stays whole"),
        (host(held=[2]), 4, [5, 6, 7, 8], "the only whole half"),
        (host(held=[1, 3, 6]), 1, [8], "the mate of the only broken pair"),
        (host(), 1, [1], "a clean host: the lowest partition id"),
        (host(degraded=[7]), 1, [5], "a degraded GPU's pair mate costs no whole pair"),
        (host(degraded=[7]), 4, [1, 2, 3, 4], "the half without the degraded GPU"),
    ],
)
def test_best_partition_in_buddy_order(gpus, count, expected, why):
    assert modules(best_partition(gpus, count)) == expected, why


def test_buddy_score_ranks_breaking_less_before_anything_else():
    # A whole pair on a busy host still costs less than the last whole host of the fleet.
    busy = host(held=[1, 3, 5, 7])
    clean = host()
    assert buddy_score(busy, BY_ID[4], tenants=4) < buddy_score(clean, BY_ID[7], tenants=0)
    # With equal breakage, the host with more tenants takes the slice.
    one_big = host(held=[1, 2, 3, 4])
    four_small = host(held=[1, 2, 3, 4])
    assert buddy_score(four_small, BY_ID[11], tenants=4) < buddy_score(one_big, BY_ID[11], tenants=1)


@pytest.mark.parametrize(
    ("hosts", "tenants", "count", "expected"),
    [
        # The broken pair's mate on b beats a whole pair on a, although a is fuller.
        ({"a": host(held=[1, 3, 2, 4, 5, 7]), "b": host(held=[1])}, {"a": 3, "b": 1}, 1, ("b", [3])),
        # Nothing but whole pairs to break: the host with more tenants.
        ({"a": host(held=[1, 3]), "b": host(held=[1, 3])}, {"a": 1, "b": 2}, 1, ("b", [2])),
        # A sliced host's whole half before a clean host.
        ({"a": host(), "b": host(held=[5])}, {"b": 1}, 4, ("b", [1, 2, 3, 4])),
        # Ties go to the lowest host id.
        ({"b": host(held=[1]), "a": host(held=[1])}, {"a": 1, "b": 1}, 1, ("a", [3])),
        ({"a": host(held=[1]), "b": host(degraded=[2])}, {"a": 1}, 8, None),
    ],
)
def test_best_placement_across_hosts(hosts, tenants, count, expected):
    got = best_placement(hosts, count, tenants)
    assert ((got[0], modules(got[1])) if got else None) == expected


def test_sequential_placements_never_overlap_and_keep_big_partitions():
    # Fill a host with a random mix in buddy order: no placement ever overlaps a live one, and four
    # single-GPU slices leave one half whole (in module order they would break both halves).
    rng = random.Random(7)
    for _ in range(200):
        gpus, live = host(), []
        while True:
            count = rng.choice((1, 1, 2, 4))
            chosen = best_partition(gpus, count)
            if chosen is None:
                break
            assert overlapping(chosen, live) == []
            live.append(chosen)
            gpus.update(dict.fromkeys(chosen.modules, HELD))
        assert sum(p.size for p in live) <= 8
    gpus = host()
    for _ in range(4):
        gpus.update(dict.fromkeys(best_partition(gpus, 1).modules, HELD))
    assert ids(feasible_partitions(gpus, 4)) == [2]


def test_overlapping_names_the_active_partitions_in_the_way():
    assert ids(overlapping(BY_ID[1], [BY_ID[3], BY_ID[6], BY_ID[14]])) == [3]
    assert ids(overlapping(BY_ID[0], [BY_ID[5], BY_ID[9]])) == [5, 9]
    assert overlapping(BY_ID[4], [BY_ID[3], BY_ID[2]]) == []


# --- why not --------------------------------------------------------------------------------------


def fleet(n, **kw):
    return {f"h{i}": host(**kw) for i in range(n)}


@pytest.mark.parametrize(
    ("hosts", "count", "expected"),
    [
        # Five hosts with one tenant in each half: 20 GPUs free, no half whole.
        (
            fleet(5, held=[1, 2, 5, 6]),
            4,
            ("no_partition", "20 GPUs free, no free 4-GPU partition: every half has a tenant"),
        ),
        (fleet(3, held=[1]), 8, ("no_partition", "21 GPUs free, no free 8-GPU partition: every host has a tenant")),
        (
            fleet(2, held=[1, 2, 5, 6]),
            2,
            ("no_partition", "8 GPUs free, no free 2-GPU partition: every pair has a tenant"),
        ),
        (
            fleet(2, degraded=[1, 5]),
            4,
            ("no_partition", "12 GPUs free, no free 4-GPU partition: every half has a degraded or excluded GPU"),
        ),
        (
            {"a": host(held=[1, 5]), "b": host(held=[1], excluded=[8])},
            4,
            (
                "no_partition",
                "12 GPUs free, no free 4-GPU partition: 3 halves have a tenant, 1 a degraded or excluded GPU",
            ),
        ),
        (
            {"a": host(held=[1, 5]), "b": host(held=[3], degraded=[7]), "c": host(excluded=[2, 8])},
            4,
            (
                "no_partition",
                "18 GPUs free, no free 4-GPU partition: 3 halves have a tenant, 3 a degraded or excluded GPU",
            ),
        ),
        (
            fleet(2, held=[1], degraded=[5]),
            8,
            ("no_partition", "12 GPUs free, no free 8-GPU partition: every host has a degraded or excluded GPU"),
        ),
        (
            {"a": host(held=[1]), "b": host(degraded=[5])},
            8,
            (
                "no_partition",
                "14 GPUs free, no free 8-GPU partition: 1 host has a tenant, 1 a degraded or excluded GPU",
            ),
        ),
        (
            {"a": host(held=[1, 2, 3, 4, 5, 6]), "b": host(held=list(MODULE_IDS))},
            4,
            ("insufficient_capacity", "2 GPUs free, 4 requested"),
        ),
        ({"a": host(held=list(MODULE_IDS))}, 1, ("no_capacity", "no GPU is free; 1 requested")),
        ({"a": host()}, 3, ("unsupported_size", "no 3-GPU partition exists: a slice has 1, 2, 4 or 8 GPUs")),
    ],
)
def test_why_not_speaks_in_partitions(hosts, count, expected):
    assert why_not(hosts, count) == expected


def test_why_not_is_none_while_some_partition_is_free():
    hosts = {"a": host(held=[1, 2, 5, 6]), "b": host(held=[1])}
    assert why_not(hosts, 4) is None
    assert why_not(hosts, 1) is None


# --- the packing benchmark keeps the rules --------------------------------------------------------


@pytest.fixture(scope="module")
def packing():
    path = Path(__file__).resolve().parents[2] / "bench" / "packing.py"
    spec = importlib.util.spec_from_file_location("bench_packing", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("policy", ["scorer", "buddy", "first_fit", "random"])
def test_every_bench_policy_places_only_partitions_under_the_rules(packing, policy, monkeypatch):
    placed = []
    take = packing.Cluster.take

    def spy(self, node, slots):
        placed.append(frozenset(packing.MODULE_OF_SLOT[packing.slot_index(s)] for s in slots))
        take(self, node, slots)  # raises on a GPU already held: a double booking

    monkeypatch.setattr(packing.Cluster, "take", spy)
    events = packing.trace(3, 4, 60.0, 0.9)
    result = packing.simulate(policy, events, 4, 3, True)
    assert placed and all(partition_for(m) is not None for m in placed)
    assert set(result["acceptance"]) == {"slice1", "slice2", "slice4", "slice8", "baremetal"}
    assert 0 < result["gpu_hours"] <= packing.fluid_upper_bound(events, 4)


def test_bench_free_form_first_fit_breaks_the_rules_that_partitions_keep(packing):
    # The control: without the rules first fit does place GPU sets that are no partition (after a 1-GPU slice
    # on module 1, a 2-GPU one on modules 3 and 2), so the check above is not vacuous.
    c = packing.Cluster(1)
    node, slots = packing.place_first_fit(c, "slice1", 1, False, random.Random(0))
    c.take(node, slots)
    node, slots = packing.place_first_fit(c, "slice2", 2, False, random.Random(0))
    assert partition_for(packing.MODULE_OF_SLOT[packing.slot_index(s)] for s in slots) is None
