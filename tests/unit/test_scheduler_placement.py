import random
from collections import Counter

import pytest

from gpuaas_scheduler.domain.approval import approval_problems, approved_status, wipe_verdict
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
    choose_slots,
    clean_node_allowed,
    node_filter,
    pick_slots,
    rank_classes,
    rank_nodes,
    summarize,
    unschedulable_summary,
)
from gpuaas_scheduler.domain.slots import incomplete_reason


def host(free_ids, node="n"):
    return [SlotView(f"s{i}", 0 if i < 4 else 1, f"sw{i // 2}", f"vf{i}") for i in free_ids]


def cand(node_id, free_ids, total=8, claims=None):
    slots = host(free_ids)
    live = (total - len(free_ids)) if claims is None else claims
    return summarize(node_id, slots, total, live, 4)


# --- slot choice ----------------------------------------------------------------------------------


def test_two_gpus_prefer_one_pcie_switch():
    chosen = choose_slots(host([0, 2, 3, 5]), 2, 4)
    assert [s.slot_id for s in chosen] == ["s2", "s3"]


def test_four_gpus_prefer_one_numa_node():
    chosen = choose_slots(host([0, 1, 4, 5, 6, 7]), 4, 4)
    assert [s.slot_id for s in chosen] == ["s4", "s5", "s6", "s7"]


def test_four_gpus_never_straddle_numa_nodes_when_the_host_has_four_per_node():
    assert choose(host([0, 1, 4, 5]), 4, 4) is None
    assert best_tier(cand("n", [0, 1, 4, 5]), 4) is None


def test_eight_gpus_span_the_minimum_numa_nodes():
    choice = choose(host(range(8)), 8, 4)
    assert choice.tier == TIER_SPAN and len(choice.slots) == 8


def test_two_gpus_fall_back_to_one_numa_node_when_no_switch_pair_is_free():
    choice = choose(host([0, 2, 5, 7]), 2, 4)
    assert choice.tier == TIER_NUMA and {s.numa_node for s in choice.slots} == {0}
    assert choose(host([0, 5]), 2, 4) is None


def test_one_gpu_takes_a_broken_pair_before_an_intact_one():
    # s1's partner is taken; s4..s7 are two intact pairs: take s1 and keep every pair.
    assert [s.slot_id for s in choose_slots(host([1, 4, 5, 6, 7]), 1, 4)] == ["s1"]


def test_one_gpu_prefers_the_emptier_numa_node_among_broken_pairs():
    # Both s1 and s5 are singletons; NUMA 1 has fewer free slots, so s5 keeps NUMA 0's 3 free.
    assert [s.slot_id for s in choose_slots(host([1, 2, 3, 5]), 1, 4)] == ["s5"]


def test_not_enough_slots_gives_none():
    assert choose_slots(host([0, 1]), 4, 4) is None


def test_the_pick_on_a_clean_host_is_its_group_and_the_sliced_summary_left_behind():
    pick = pick_slots("n", host(range(8)), 2, 8, 4)
    assert pick.node_id == "n" and pick.choice == choose(host(range(8)), 2, 4)
    assert [s.slot_id for s in pick.slots] == ["s0", "s1"]
    # What the claim records on the node row: the summary of the six slots left, with one live claim at least.
    assert pick.after == summarize("n", host(range(2, 8)), 8, 1, 4)
    assert pick.after.sliced and pick.after.max_switch_free == 2 and pick.after.numa_free == (4, 2)


def test_no_pick_where_no_topology_safe_group_is_free():
    assert pick_slots("n", host([0, 1, 4, 5]), 4, 8, 4) is None


def test_duplicated_fabric_devices_never_share_a_group():
    slots = [SlotView("a", 0, "sw0", "vf1"), SlotView("b", 0, "sw0", "vf1"), SlotView("c", 0, "sw1", "vf2")]
    choice = choose(slots, 2, 4)
    assert {s.fabric_device for s in choice.slots} == {"vf1", "vf2"}
    assert choose(slots[:2], 2, 4) is None


def test_unknown_numa_slots_serve_single_gpus_only():
    slots = [SlotView("a", None, None), SlotView("b", None, None)]
    assert choose(slots, 1) is not None
    assert choose(slots, 2) is None


# --- ranking ----------------------------------------------------------------------------------------


def test_sliced_nodes_first_then_topology_then_best_fit_then_id():
    nodes = [
        cand("clean-a", range(8)),
        cand("sliced-roomy", [2, 3, 4, 5, 6, 7]),
        cand("sliced-tight", [6, 7]),
        cand("sliced-tight-b", [6, 7]),
        cand("sliced-split", [1, 3]),  # 2 free on one NUMA node, no free pair
    ]
    assert [n.node_id for n in rank_nodes(nodes, 2)] == [
        "sliced-tight",
        "sliced-tight-b",
        "sliced-roomy",
        "sliced-split",
        "clean-a",
    ]
    assert [n.node_id for n in rank_nodes(nodes, 4)] == ["sliced-roomy", "clean-a"]
    assert [n.node_id for n in rank_nodes(nodes, 1)][:3] == ["sliced-split", "sliced-tight", "sliced-tight-b"]
    assert [n.node_id for n in rank_nodes(nodes, 8)] == ["clean-a"]


def test_ranking_is_deterministic_under_input_order():
    rng = random.Random(7)
    nodes = [cand(f"n{i:02d}", sorted(rng.sample(range(8), rng.randint(1, 8)))) for i in range(40)]
    for gpus in (1, 2, 4, 8):
        first = rank_nodes(nodes, gpus)
        for _ in range(5):
            rng.shuffle(nodes)
            assert rank_nodes(nodes, gpus) == first


def test_rank_classes_cover_the_score_order():
    rng = random.Random(3)
    nodes = [cand(f"n{i:02d}", sorted(rng.sample(range(8), rng.randint(1, 8)))) for i in range(60)]
    for gpus in (1, 2, 4, 8):
        expected = rank_nodes(nodes, gpus)
        by_class = []
        for sliced, tier in rank_classes(gpus):
            members = [n for n in nodes if n.sliced == sliced and best_tier(n, gpus) == tier]
            by_class += sorted(members, key=lambda n: (n.free_slots, n.node_id))
        assert by_class == expected


def test_clean_node_watermark():
    assert clean_node_allowed(3, 2)
    assert not clean_node_allowed(2, 2)
    assert clean_node_allowed(1, 0)


# --- filters and why-not ----------------------------------------------------------------------------


def facts(**kw):
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
        live_claims=0,
        exclusive_held=False,
        candidate=cand("n1", range(8)),
        preflight_status="passed",
    )
    base.update(kw)
    return NodeFacts(**base)


@pytest.mark.parametrize(
    "change,bucket",
    [
        ({"region": "r2"}, "region"),
        ({"sku": "other"}, "sku"),
        ({"accepts_slices": False}, "profile_intent"),
        ({"mode": "baremetal"}, "host_mode"),
        ({"mode": "converting"}, "host_mode"),
        ({"mode": "drained"}, "host_mode"),
        ({"mode": "retired"}, "host_mode"),
        ({"maintenance": True}, "maintenance"),
        ({"draining": True}, "draining"),
        ({"schedulable": False}, "not_ready"),
        ({"preflight_status": None}, "preflight_missing"),
        ({"preflight_status": "missing"}, "preflight_missing"),
        ({"preflight_status": "failed"}, "preflight_failed"),
        ({"preflight_status": "failed", "parity_failures": 3}, "preflight_failed"),
        ({"parity_failures": None}, "parity"),
        ({"parity_failures": 2}, "parity"),
        ({"exclusive_held": True}, "in_use"),
        ({"candidate": cand("n1", [0, 1])}, "free_slot_count"),
        ({"candidate": cand("n1", [0, 2, 4, 6])}, "topology"),
        ({}, None),
    ],
)
def test_each_filter_names_its_bucket(change, bucket):
    assert node_filter(facts(**change), Request("gpu_slice", 4, "r1", "h200-sxm-slice")) == bucket


def test_baremetal_filters():
    req = Request("baremetal", 8, "r1", "h200-sxm")
    node = facts(sku="h200-sxm", accepts_baremetal=True, accepts_slices=False, mode="baremetal", parity_failures=None)
    assert node_filter(node, req) is None
    # The commissioning preflight gates slice capability only: a whole host needs no VFIO firmware.
    assert (
        node_filter(
            facts(
                sku="h200-sxm",
                accepts_baremetal=True,
                mode="baremetal",
                preflight_status="failed",
                accepts_slices=False,
            ),
            req,
        )
        is None
    )
    assert node_filter(facts(sku="h200-sxm", accepts_baremetal=True, mode="baremetal", live_claims=1), req) == "in_use"
    assert node_filter(facts(sku="h200-sxm"), req) == "profile_intent"


@pytest.mark.parametrize("mode", ["slice", "converting", "drained", "retired"])
def test_baremetal_takes_only_baremetal_mode_hosts(mode):
    # Both profile tags: the tag alone must not make a slice (or converting...) host a baremetal candidate.
    node = facts(sku="h200-sxm", accepts_baremetal=True, accepts_slices=True, mode=mode)
    assert node_filter(node, Request("baremetal", 8, "r1", "h200-sxm")) == "host_mode"


def test_a_baremetal_mode_host_still_holding_approved_slots_is_not_handed_out():
    node = facts(sku="h200-sxm", accepts_baremetal=True, mode="baremetal", approved_slots=1)
    assert node_filter(node, Request("baremetal", 8, "r1", "h200-sxm")) == "approved_slots"
    code, reason = unschedulable_summary(Counter({"host_mode": 2, "approved_slots": 1}), 0, 8, "baremetal", 0)
    assert code == "no_eligible_node"
    assert "2 in a host mode that does not serve this shape" in reason and "1 still holding approved slots" in reason


def test_reason_texts_are_precise():
    code, reason = unschedulable_summary(Counter({"topology": 3}), free_gpus=12, requested=4, eligible_nodes=3)
    assert code == "topology" and reason.startswith("12 GPUs free but no node has 4 topology-safe slots")
    code, reason = unschedulable_summary(
        Counter({"free_slot_count": 4}), free_gpus=12, requested=4, eligible_nodes=4, largest_free=3
    )
    assert code == "fragmented" and "12 GPUs free but no node has 4 free slots (largest: 3)" in reason
    code, reason = unschedulable_summary(Counter({"draining": 2, "parity": 1}), 0, 1, eligible_nodes=0)
    assert code == "no_eligible_node" and "2 draining" in reason and "1 without parity failures=0" in reason
    assert unschedulable_summary(Counter(), 3, 4, eligible_nodes=2)[0] == "insufficient_capacity"
    assert unschedulable_summary(Counter(), 0, 4, eligible_nodes=2)[0] == "no_capacity"


# --- approval rules -----------------------------------------------------------------------------------

GOOD = {
    "slot_id": "x",
    "gpu_pci_address": "0000:18:00.0",
    "nvme_by_id": "/dev/disk/by-id/nvme-eui.1",
    "mac": "52:54:00:00:00:01",
    "private_ip": "10.100.0.10",
    "fabric_claim_mode": "per_slot_vf",
    "fabric_vf_pci_address": "0000:29:00.1",
    "nvme_evidence": {"mounted": False, "mounted_children": [], "signatures": [], "is_os_disk": False},
}


@pytest.mark.parametrize(
    "change,needle",
    [
        ({"gpu_pci_address": None}, "GPU PCI"),
        ({"nvme_by_id": None}, "by-id"),
        ({"nvme_by_id": "/dev/nvme0n1"}, "by-id"),
        ({"mac": None}, "MAC"),
        ({"private_ip": ""}, "private IP"),
        ({"fabric_claim_mode": "shared"}, "per_slot_vf"),
        ({"fabric_vf_pci_address": ""}, "fabric VF"),
        ({"nvme_evidence": None}, "no NVMe evidence"),
        ({"nvme_evidence": {**GOOD["nvme_evidence"], "mounted": True}}, "is mounted"),
        ({"nvme_evidence": {**GOOD["nvme_evidence"], "mounted_children": ["nvme0n1p1"]}}, "mounted children"),
        ({"nvme_evidence": {**GOOD["nvme_evidence"], "signatures": ["ext4"]}}, "unexpected filesystems"),
        ({"nvme_evidence": {**GOOD["nvme_evidence"], "signatures": None}}, "could not be read"),
        ({"nvme_evidence": {**GOOD["nvme_evidence"], "is_os_disk": True}}, "OS disk"),
    ],
)
def test_each_approval_rule_keeps_the_slot_disabled(change, needle):
    problems = approval_problems({**GOOD, **change})
    status, reason = approved_status(problems)
    assert status == "disabled" and needle in reason


def test_complete_candidate_is_available():
    assert approved_status(approval_problems(GOOD)) == ("available", None)
    assert incomplete_reason(GOOD) is None


@pytest.mark.parametrize("key", ["nvme_by_id", "mac", "private_ip", "fabric_vf_pci_address"])
def test_bindings_owned_by_another_slot_are_refused(key):
    other = {
        **GOOD,
        "slot_id": "y",
        "gpu_pci_address": "0000:2a:00.0",
        "nvme_by_id": "/dev/disk/by-id/nvme-eui.2",
        "mac": "52:54:00:00:00:02",
        "private_ip": "10.100.0.11",
        "fabric_vf_pci_address": "0000:29:00.2",
    }
    other[key] = GOOD[key]
    problems = approval_problems(GOOD, [other])
    assert any(key in p and "slot y" in p for p in problems)


def test_wipe_verdict():
    slot = {"nvme_by_id": "/dev/disk/by-id/nvme-eui.1"}
    ok = {"device": slot["nvme_by_id"], "method": "blkdiscard", "verified": True, "signatures": []}
    assert wipe_verdict(slot, [ok]) is None
    assert "no wipe proof" in wipe_verdict(slot, [{**ok, "device": "/dev/disk/by-id/other"}])
    assert "not verified" in wipe_verdict(slot, [{**ok, "verified": False}])
    assert "signatures remain" in wipe_verdict(slot, [{**ok, "signatures": ["gpt"]}])


@pytest.mark.parametrize(
    ("policy", "method", "accepted"),
    [
        ("blkdiscard", "blkdiscard", True),
        ("blkdiscard", "blkdiscard+zeroout", True),
        ("blkdiscard", "zero_fill", True),
        ("nvme_format", "nvme_format", True),
        ("nvme_format", "blkdiscard", False),
        ("crypto_erase", "crypto_erase", True),
        ("crypto_erase", "nvme_format", False),
        ("crypto_erase", "blkdiscard", False),
        ("blkdiscard", "failed", False),
    ],
)
def test_wipe_verdict_needs_a_method_of_the_slots_policy(policy, method, accepted):
    slot = {"nvme_by_id": "/dev/disk/by-id/nvme-eui.1", "destructive_wipe_policy": policy}
    proof = {"device": slot["nvme_by_id"], "method": method, "verified": True, "signatures": []}
    verdict = wipe_verdict(slot, [proof])
    assert (verdict is None) == accepted, verdict
    if not accepted:
        assert f"{policy} policy" in verdict


def test_summary_counts_duplicated_fabric_once():
    slots = [SlotView("a", 0, "sw0", "vf1"), SlotView("b", 0, "sw0", "vf1")]
    summary = summarize("n", slots, 2, 0, 2)
    assert summary.free_slots == 1 and summary.max_switch_free == 1
    assert NodeCandidate("n", 8, 8).sliced is False
    assert best_tier(cand("n", [0, 1]), 2) == TIER_SWITCH
