"""Parity's `vfio_binding` against the approved slots (issue 26, point 5): a host that bound only some of the
devices its approved slots pass through fails, naming each device left out; emulated slots are skipped."""

from __future__ import annotations

from pathlib import Path

from gpuaas_dev.sim.fixture_host import build_host_root, xe9680l
from gpuaas_node_agent.adapters.host import Host
from gpuaas_node_agent.adapters.parity import ParityChecker
from gpuaas_node_agent.service_layer.device_binding import enter_slice_mode

SLOTS = [
    {"slot_id": "s0", "gpu_pci_address": "0000:18:00.0", "fabric_vf_pci_address": "0000:29:00.1"},
    {"slot_id": "s1", "gpu_pci_address": "0000:2a:00.0", "fabric_vf_pci_address": "0000:29:00.2"},
    # An emulated slot: nothing passed through, nothing to check.
    {"slot_id": "s2", "gpu_pci_address": None, "fabric_vf_pci_address": None},
]


async def _vfio(host: Host, slots: list) -> object:
    report = await ParityChecker(host, approved_slots=slots).run("xe9680l-01")
    return next(c for c in report.checks if c.check == "vfio_binding")


async def test_partial_binding_fails_naming_each_device_left_out(tmp_path: Path) -> None:
    root = build_host_root(
        tmp_path / "host", xe9680l(disk_file_bytes=1 << 20, driverctl_overrides=False, nvidia_bound_gpus=8)
    )
    host = Host.at(root)
    # Only the first slot's devices were bound (by hand): the second slot's GPU and VF were left out.
    await enter_slice_mode(host, ["0000:18:00.0", "0000:29:00.1"])
    check = await _vfio(host, SLOTS)
    assert check.status == "FAIL"
    assert check.detail.startswith("2 of 4 approved devices not on vfio-pci: ")
    assert "0000:2a:00.0 no persistent vfio-pci override, bound to nvidia" in check.detail
    # The fixture's VFs sit on vfio-pci already, but without an override a reboot gives them back.
    assert "0000:29:00.2 no persistent vfio-pci override;" in check.detail
    assert "0000:18:00.0" not in check.detail and "0000:29:00.1" not in check.detail
    # Without the approved slots the same host passes: the override set alone cannot see a partial binding.
    assert (await _vfio(host, [])).status == "PASS"
    # Every approved device bound: PASS, and the emulated slot was no device to look for.
    await enter_slice_mode(host, ["0000:18:00.0", "0000:29:00.1", "0000:2a:00.0", "0000:29:00.2"])
    check = await _vfio(host, SLOTS)
    assert check.status == "PASS" and check.detail == "4 approved devices on vfio-pci"


async def test_only_emulated_slots_and_no_override_is_still_not_slice_mode(tmp_path: Path) -> None:
    root = build_host_root(
        tmp_path / "host", xe9680l(disk_file_bytes=1 << 20, driverctl_overrides=False, nvidia_bound_gpus=8)
    )
    check = await _vfio(Host.at(root), SLOTS[2:])
    assert check.status == "FAIL" and "has not entered slice mode" in check.detail
