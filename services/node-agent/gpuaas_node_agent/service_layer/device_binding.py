"""Entering and leaving slice mode on the host: persistent driverctl overrides for the approved GPU and fabric
devices (from the approved slots, never a hard-coded list), removed again when the host leaves slice mode."""

from __future__ import annotations

from collections.abc import Iterable

from gpuaas_common.contract import messages as m
from gpuaas_common.logging import get_logger

from ..adapters import driverctl
from ..adapters.host import Host
from ..domain.device_binding import BindingPlan, approved_devices, plan, wrong_bindings

log = get_logger(__name__)


def slot_devices(slots: Iterable[m.SlotBinding]) -> list[str]:
    return approved_devices((s.gpu_pci_address, s.fabric_vf_pci_address) for s in slots)


async def enter_slice_mode(host: Host, devices: Iterable[str]) -> BindingPlan:
    """Write a vfio-pci override for every approved device, drop vfio-pci overrides no longer approved, then
    verify every approved device is bound to vfio-pci."""
    wanted = sorted(set(devices))
    missing = [d for d in wanted if not host.fs.exists(f"/sys/bus/pci/devices/{d}")]
    if missing:
        raise driverctl.DriverctlError("approved devices not on this host: " + ",".join(missing))
    todo = plan(wanted, await driverctl.list_overrides(host))
    for bdf in todo.unset_override:
        await driverctl.unset_override(host, bdf)
    for bdf in todo.set_override:
        await driverctl.set_vfio_override(host, bdf)
    wrong = wrong_bindings({d: driverctl.bound_driver(host, d) for d in wanted})
    if wrong:
        raise driverctl.DriverctlError("not bound to vfio-pci after override: " + "; ".join(wrong))
    log.info("slice_mode_entered", devices=len(wanted), set=list(todo.set_override), unset=list(todo.unset_override))
    return todo


async def leave_slice_mode(host: Host) -> BindingPlan:
    """Remove every vfio-pci override: the devices go back to their host drivers."""
    todo = plan([], await driverctl.list_overrides(host))
    for bdf in todo.unset_override:
        await driverctl.unset_override(host, bdf)
    log.info("slice_mode_left", unset=list(todo.unset_override))
    return todo
