"""Device binding plan: overrides from the approved slots, idempotent, and only vfio-pci overrides removed."""

from __future__ import annotations

from gpuaas_node_agent.domain.device_binding import (
    approved_devices,
    binding_problems,
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
