"""Host drift as placement sees it: where a reported item lands (slots by id or device, else the node), how a
newer report replaces the held drift, and the `drift_reported` why-not bucket."""

from __future__ import annotations

from gpuaas_scheduler.domain.drift import Item, current_items, places, reconcile
from gpuaas_scheduler.domain.placement import NODE_LEVEL, Request, node_filter

from .test_scheduler_placement import cand, facts

SLOTS = [
    {
        "slot_id": f"n1-s{i}",
        "gpu_pci_address": f"0000:{0x18 + i:02x}:00.0",
        "fabric_vf_pci_address": f"0000:29:00.{i + 1}",
        "nvme_by_id": f"/dev/disk/by-id/nvme-{i}",
        "mac": f"52:54:00:00:00:{i:02x}",
        "private_ip": f"10.100.0.{10 + i}",
    }
    for i in range(4)
]


def test_an_item_lands_on_the_slots_it_names_by_id_or_device_else_on_the_node() -> None:
    assert places(["n1-s2"], [], SLOTS) == ["n1-s2"]
    assert places([], ["0000:19:00.0"], SLOTS) == ["n1-s1"]
    assert places([], ["0000:29:00.4", "/dev/disk/by-id/nvme-0"], SLOTS) == ["n1-s0", "n1-s3"]
    assert places([], ["52:54:00:00:00:02", "10.100.0.99"], SLOTS) == ["n1-s2"]
    # A slot id of another node, or a device no slot has: the node as a whole.
    assert places(["n9-s0"], ["0000:ff:00.0"], SLOTS) == [None]
    assert places([], [], SLOTS) == [None]


def test_swept_items_never_stand_and_a_newer_report_replaces_the_held_drift() -> None:
    reported = current_items(
        [
            ("device_binding", "0000:18:00.0", "bound to nvidia", False, [], ["0000:18:00.0"]),
            ("dhcp_reservation_orphaned", "gpuaas-1", "released", True, [], []),
            ("domain_unmanaged", "stray", "no record", False, [], []),
        ],
        SLOTS,
    )
    assert set(reported) == {("device_binding", "0000:18:00.0", "n1-s0"), ("domain_unmanaged", "stray", None)}
    held = [("domain_unmanaged", "stray", None), ("disk_dirty", "/dev/disk/by-id/nvme-1", "n1-s1")]
    change = reconcile(held, reported)
    assert set(change.open) == {("device_binding", "0000:18:00.0", "n1-s0")}
    assert set(change.still) == {("domain_unmanaged", "stray", None)}
    assert change.resolve == (("disk_dirty", "/dev/disk/by-id/nvme-1", "n1-s1"),)
    assert reconcile(held, {}).resolve == tuple(sorted(held, key=lambda k: (k[0], k[1], k[2] or "")))
    assert reported[("domain_unmanaged", "stray", None)] == Item("domain_unmanaged", "stray", "no record", ())


def test_drift_is_its_own_why_not_bucket() -> None:
    req = Request(region="r1", sku="h200-sxm-slice", gpus=4, shape="gpu_slice")
    assert node_filter(facts(drift_open=True), req) == "drift_reported"
    assert "drift_reported" in NODE_LEVEL
    # Three free, one more free but for drift: drift is why; with too few even counting it, it is not.
    assert node_filter(facts(candidate=cand("n1", range(3)), drifted_free_slots=1), req) == "drift_reported"
    assert node_filter(facts(candidate=cand("n1", range(2)), drifted_free_slots=1), req) == "free_slot_count"
    assert node_filter(facts(drifted_free_slots=2), req) is None
