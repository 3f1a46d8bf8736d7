"""Device binding plan: overrides from the approved slots, idempotent, and only vfio-pci overrides removed."""

from __future__ import annotations

import pytest

from gpuaas_common.contract import messages as m
from gpuaas_node_agent.domain.device_binding import (
    approved_devices,
    binding_problems,
    derive_binding,
    parse_list_overrides,
    plan,
    wrong_bindings,
)


def test_approved_devices_are_the_slots_gpus_and_vfs_deduplicated() -> None:
    slots = [("0000:18:00.0", "0000:29:00.1"), ("0000:2a:00.0", None), ("0000:18:00.0", "0000:29:00.1")]
    assert approved_devices(slots) == ["0000:18:00.0", "0000:29:00.1", "0000:2a:00.0"]


def test_plan_sets_missing_keeps_present_and_removes_only_stale_vfio_overrides() -> None:
    current = {"0000:18:00.0": "vfio-pci", "0000:3a:00.0": "vfio-pci", "0000:03:00.0": "nvme", "0000:2a:00.0": "nvidia"}
    p = plan(["0000:18:00.0", "0000:2a:00.0"], current)
    assert p.set_override == ("0000:2a:00.0",)
    assert p.unset_override == ("0000:3a:00.0",)  # an operator's non-vfio override is not ours to remove
    assert plan(["0000:18:00.0"], {"0000:18:00.0": "vfio-pci"}).empty


def test_wrong_bindings_names_each_device_off_vfio() -> None:
    assert wrong_bindings({"0000:18:00.0": "vfio-pci", "0000:2a:00.0": "nvidia", "0000:29:00.1": None}) == [
        "0000:29:00.1 bound to no driver",
        "0000:2a:00.0 bound to nvidia",
    ]


def test_list_overrides_output_is_parsed() -> None:
    assert parse_list_overrides("0000:18:00.0 vfio-pci\n\n0000:29:00.1 vfio-pci\n") == {
        "0000:18:00.0": "vfio-pci",
        "0000:29:00.1": "vfio-pci",
    }


def test_binding_problems_cover_every_approved_device_and_only_what_is_wrong() -> None:
    gpu, vf, other, gone, nvme = "0000:18:00.0", "0000:29:00.1", "0000:3a:00.0", "0000:5d:00.0", "0000:03:00.0"
    overrides = {vf: "vfio-pci", other: "vfio-pci", gone: "vfio-pci", nvme: "nvme", gpu: "nvidia"}
    bound = {gpu: "nvidia", vf: "vfio-pci", other: None, nvme: "nvme"}
    problems = binding_problems([gpu, vf], overrides, bound, present=[gpu, vf, other, nvme])
    assert problems == {
        # A slot's GPU overridden to its host driver: neither persistent nor bound.
        gpu: ["no persistent vfio-pci override (override to nvidia)", "bound to nvidia"],
        # An override nobody used yet is an approved device all the same.
        other: ["bound to no driver"],
        gone: ["not on this host"],
    }
    assert binding_problems([], {}, {}, present=[]) == {}
    assert binding_problems([gpu], {}, {gpu: "vfio-pci"}, present=[gpu]) == {gpu: ["no persistent vfio-pci override"]}


# --- the binding derived from the approved slots (issue 26, point 5) ------------------------------------------

_GPU_A, _VF_A, _GPU_B, _VF_B = "0000:18:00.0", "0000:29:00.1", "0000:2a:00.0", "0000:29:00.2"
_MODULES = "/etc/modules-load.d/gpuaas-vfio.conf"


@pytest.mark.parametrize(
    ("slots", "devices"),
    [
        # Two GPU slots with a fabric VF each: all four on vfio-pci.
        (
            [
                {"gpu_pci_address": _GPU_A, "fabric_vf_pci_address": _VF_A},
                {"gpu_pci_address": _GPU_B, "fabric_vf_pci_address": _VF_B},
            ],
            [_GPU_A, _GPU_B, _VF_A, _VF_B],
        ),
        # A slot with no fabric VF (fabric_claim_mode none): its GPU alone.
        ([{"gpu_pci_address": _GPU_A, "fabric_vf_pci_address": None}], [_GPU_A]),
        # The same slot twice (two tasks named it): once.
        ([{"gpu_pci_address": _GPU_A, "fabric_vf_pci_address": _VF_A}] * 2, [_GPU_A, _VF_A]),
        # An emulated slot (a lab host's) passes nothing through; mixed with a GPU slot it adds nothing.
        ([{"gpu_pci_address": None, "fabric_vf_pci_address": None}], []),
        (
            [
                {"gpu_pci_address": None, "fabric_vf_pci_address": None},
                {"gpu_pci_address": _GPU_B, "fabric_vf_pci_address": None},
            ],
            [_GPU_B],
        ),
        ([], []),
    ],
)
def test_binding_is_derived_from_the_approved_non_emulated_slots(slots: list, devices: list) -> None:
    b = derive_binding(slots)
    assert b.devices == sorted(devices)
    assert b.driver_override == {d: "vfio-pci" for d in devices}
    expected = {f"/etc/driverctl.d/pci-{d}": "vfio-pci\n" for d in devices}
    if devices:
        expected[_MODULES] = "vfio\nvfio_iommu_type1\nvfio_pci\n"
    assert b.persistent == expected


def test_binding_takes_slot_bindings_as_the_contract_carries_them() -> None:
    slot = m.SlotBinding(
        slot_id="slot-0",
        gpu_pci_address=_GPU_A,
        nvme_by_id="/dev/disk/by-id/nvme-eui.01",
        fabric_vf_pci_address=_VF_A,
        mac="52:54:00:00:00:01",
        private_ip="10.100.0.10",
        ovs_bridge="ovsbr0",
        profile="h200_1g_24c_64g",
    )
    assert derive_binding([slot]).devices == [_GPU_A, _VF_A]


def test_a_binding_naming_a_device_off_the_hosts_topology_is_refused_by_name() -> None:
    from gpuaas_node_agent.domain.device_binding import refused_devices

    gpus, vfs = ["0000:18:00.0", "0000:2a:00.0"], ["0000:29:00.1"]
    assert refused_devices(["0000:18:00.0", "0000:29:00.1"], gpus, vfs) == []
    # The fabric PF and the OS disk's controller: vfio-pci there takes them from the host.
    assert refused_devices(["0000:29:00.0", "0000:18:00.0", "0000:c1:00.0"], gpus, vfs) == [
        "0000:29:00.0 is not a GPU or fabric VF of this host's topology",
        "0000:c1:00.0 is not a GPU or fabric VF of this host's topology",
    ]


def test_an_unbind_releases_only_what_the_approved_binding_holds() -> None:
    from gpuaas_node_agent.domain.device_binding import release_set

    approved = [
        {"slot_id": "s0", "gpu_pci_address": "0000:18:00.0", "fabric_vf_pci_address": "0000:29:00.1"},
        {"slot_id": "s1", "gpu_pci_address": "0000:2a:00.0", "fabric_vf_pci_address": None},
    ]
    assert release_set([("0000:18:00.0", "0000:29:00.1")], approved) == ["0000:18:00.0", "0000:29:00.1"]
    assert release_set([("0000:5d:00.0", None)], approved) == []
    assert release_set([("0000:2a:00.0", "0000:77:00.3")], approved) == ["0000:2a:00.0"]
    assert release_set([("0000:18:00.0", None)], []) == []
