"""Which devices a slice-mode host keeps on vfio-pci, and the driverctl overrides that get it there. Pure.

The approved topology (the slots the agent is given) names the devices; nothing here knows a PCI address
of its own. `plan` turns the wanted set and the host's current overrides into the overrides to set and the
ones to remove, so entering slice mode twice changes nothing and leaving it removes only vfio-pci overrides.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

VFIO_DRIVER = "vfio-pci"


@dataclass(frozen=True)
class BindingPlan:
    set_override: tuple[str, ...]
    unset_override: tuple[str, ...]

    @property
    def empty(self) -> bool:
        return not (self.set_override or self.unset_override)


def approved_devices(slots: Iterable[tuple[str, str | None]]) -> list[str]:
    """GPU and fabric VF addresses of the approved slots ((gpu, vf) pairs), sorted, without duplicates."""
    out: set[str] = set()
    for gpu, vf in slots:
        out.add(gpu)
        if vf:
            out.add(vf)
    return sorted(out)


DRIVERCTL_DIR = "/etc/driverctl.d"
VFIO_MODULES_LOAD = "/etc/modules-load.d/gpuaas-vfio.conf"


@dataclass(frozen=True)
class VfioBinding:
    """The binding a slice-mode host's approved slots call for: per passed-through device the sysfs
    `driver_override` value, and the persistent files that keep it across a reboot (driverctl's one file per
    override, read by its udev rule at boot; the VFIO modules loaded at boot, as the runbook stages them)."""

    driver_override: dict[str, str]
    persistent: dict[str, str]

    @property
    def devices(self) -> list[str]:
        return sorted(self.driver_override)


def slot_pairs(slots: Iterable[Mapping[str, object] | object]) -> list[tuple[str | None, str | None]]:
    """(gpu, fabric VF) of each slot, whether given as a SlotBinding or as the dict a task carried it as."""
    out: list[tuple[str | None, str | None]] = []
    for s in slots:
        get = s.get if isinstance(s, Mapping) else (lambda k, _s=s: getattr(_s, k, None))
        out.append((get("gpu_pci_address"), get("fabric_vf_pci_address")))  # type: ignore[arg-type]
    return out


def derive_binding(slots: Iterable[Mapping[str, object] | object]) -> VfioBinding:
    """The host's VFIO binding from its approved slots: the GPU and fabric VF of every slot that passes one
    through; an emulated slot (neither) adds nothing, and a host of only emulated slots needs no config."""
    devices = sorted({d for pair in slot_pairs(slots) for d in pair if d})
    persistent = {f"{DRIVERCTL_DIR}/pci-{d}": f"{VFIO_DRIVER}\n" for d in devices}
    if devices:
        persistent[VFIO_MODULES_LOAD] = "vfio\nvfio_iommu_type1\nvfio_pci\n"
    return VfioBinding({d: VFIO_DRIVER for d in devices}, persistent)


def plan(wanted: Iterable[str], current: Mapping[str, str]) -> BindingPlan:
    """Overrides to write (wanted, not already vfio-pci) and to remove (vfio-pci, no longer wanted)."""
    want = set(wanted)
    to_set = sorted(d for d in want if current.get(d) != VFIO_DRIVER)
    to_unset = sorted(d for d, drv in current.items() if drv == VFIO_DRIVER and d not in want)
    return BindingPlan(tuple(to_set), tuple(to_unset))


def wrong_bindings(bound: Mapping[str, str | None]) -> list[str]:
    """'<bdf> bound to <driver>' for every device whose bound driver is not vfio-pci."""
    return [f"{bdf} bound to {drv or 'no driver'}" for bdf, drv in sorted(bound.items()) if drv != VFIO_DRIVER]


def parse_list_overrides(text: str) -> dict[str, str]:
    """`driverctl list-overrides` output: one '<device> <driver>' per line (other lines ignored)."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        words = line.split()
        if len(words) >= 2:
            out[words[0]] = words[1]
    return out


def binding_problems(
    wanted: Iterable[str], overrides: Mapping[str, str], bound: Mapping[str, str | None], present: Iterable[str]
) -> dict[str, list[str]]:
    """Per device that should sit on vfio-pci (the host's vfio-pci overrides plus `wanted`, the devices of the
    slots the agent was handed), what is wrong with it: no persistent vfio-pci override (a reboot would give
    it back to its host driver), not on the host, or bound to another driver now. Devices without a problem
    are left out."""
    here = set(present)
    out: dict[str, list[str]] = {}
    for dev in sorted(set(wanted) | {d for d, drv in overrides.items() if drv == VFIO_DRIVER}):
        problems = []
        if overrides.get(dev) != VFIO_DRIVER:
            other = overrides.get(dev)
            problems.append(f"no persistent vfio-pci override{f' (override to {other})' if other else ''}")
        if dev not in here:
            problems.append("not on this host")
        elif bound.get(dev) != VFIO_DRIVER:
            problems.append(f"bound to {bound.get(dev) or 'no driver'}")
        if problems:
            out[dev] = problems
    return out


def refused_devices(asked: Iterable[str], gpus: Iterable[str], fabric_vfs: Iterable[str]) -> list[str]:
    """'<bdf> is not …' for every device a binding asks for that the host's own topology does not show as a GPU
    or a fabric VF: the binding is refused whole, since vfio-pci on any other device (the OS disk's controller,
    the management NIC) takes it from the host."""
    gpu_set, vf_set = set(gpus), set(fabric_vfs)
    out = []
    for dev in sorted(set(asked)):
        if dev not in gpu_set and dev not in vf_set:
            out.append(f"{dev} is not a GPU or fabric VF of this host's topology")
    return out


def release_set(named: Iterable[tuple[str | None, str | None]], approved: Iterable[Mapping[str, object]]) -> list[str]:
    """The devices an unbind releases: those of the named slots that the host's approved binding holds. A name
    the binding does not hold releases nothing (a stale or forged unbind cannot take a device it never bound)."""
    held = {d for pair in slot_pairs(approved) for d in pair if d}
    return sorted({d for pair in named for d in pair if d and d in held})
