from collections import Counter

from gpuaas_scheduler.domain.placement import (
    NodeCandidate,
    SlotView,
    choose_slots,
    incomplete_reason,
    rank_nodes,
    unschedulable_summary,
)


def host(free_ids):
    return [SlotView(f"s{i}", 0 if i < 4 else 1, f"sw{i // 2}") for i in free_ids]


def test_two_gpus_prefer_one_pcie_switch():
    chosen = choose_slots(host([0, 2, 3, 5]), 2)
    assert [s.slot_id for s in chosen] == ["s2", "s3"]


def test_four_gpus_prefer_one_numa_node():
    chosen = choose_slots(host([0, 1, 4, 5, 6, 7]), 4)
    assert [s.slot_id for s in chosen] == ["s4", "s5", "s6", "s7"]


def test_not_enough_slots_gives_none():
    assert choose_slots(host([0, 1]), 4) is None


def test_sliced_nodes_first_then_best_fit_then_id():
    nodes = [
        NodeCandidate("clean-a", free_slots=8, total_slots=8, live_claims=0),
        NodeCandidate("sliced-roomy", free_slots=6, total_slots=8, live_claims=2),
        NodeCandidate("sliced-tight", free_slots=2, total_slots=8, live_claims=6),
        NodeCandidate("sliced-tight-b", free_slots=2, total_slots=8, live_claims=6),
    ]
    assert [n.node_id for n in rank_nodes(nodes, 2)] == ["sliced-tight", "sliced-tight-b", "sliced-roomy", "clean-a"]
    assert [n.node_id for n in rank_nodes(nodes, 4)] == ["sliced-roomy", "clean-a"]


def test_ranking_is_deterministic_under_input_order():
    nodes = [NodeCandidate(f"n{i}", free_slots=(i % 3) + 1, total_slots=8, live_claims=i % 2) for i in range(12)]
    assert rank_nodes(nodes, 1) == rank_nodes(list(reversed(nodes)), 1)


def test_incomplete_slots_are_named():
    complete = {"gpu_pci_address": "0000:18:00.0", "nvme_by_id": "/dev/disk/by-id/nvme-eui.1", "mac": "52:54:00:00:00:01",
                "private_ip": "127.100.1.10", "fabric_claim_mode": "per_slot_vf", "fabric_vf_pci_address": "0000:29:00.1"}
    assert incomplete_reason(complete) is None
    assert "VF" in incomplete_reason({**complete, "fabric_vf_pci_address": ""})
    assert "per_slot_vf" in incomplete_reason({**complete, "fabric_claim_mode": "shared"})
    assert "by-id" in incomplete_reason({**complete, "nvme_by_id": "/dev/nvme0n1"})


def test_fragmentation_is_reported_as_such():
    code, reason = unschedulable_summary(Counter({"free_slot_count": 4}), free_gpus=12, requested=4)
    assert code == "fragmented" and "12 GPUs free" in reason
