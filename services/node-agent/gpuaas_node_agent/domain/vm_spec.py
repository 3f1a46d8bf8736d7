"""What a slice VM is made of, validated before anything touches the host. Pure."""

from __future__ import annotations

import re
import uuid as uuid_mod
from typing import Literal, NamedTuple

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

# Debian/Ubuntu OVMF build with 4 MiB flash; Secure Boot stays off (guest NVIDIA driver install hangs on MOK).
DEFAULT_LOADER_PATH = "/usr/share/OVMF/OVMF_CODE_4M.fd"
DEFAULT_NVRAM_TEMPLATE_PATH = "/usr/share/OVMF/OVMF_VARS_4M.fd"

_PCI = re.compile(r"^([0-9a-fA-F]{4}):([0-9a-fA-F]{2}):([0-9a-fA-F]{2})\.([0-7])$")
_MAC = re.compile(r"^[0-9a-f]{2}(:[0-9a-f]{2}){5}$")
# libvirt accepts more, but the name also becomes a file name (reservation, seed ISO, NVRAM).
_VM_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
_BRIDGE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,14}$")  # IFNAMSIZ - 1
_CPUSET = re.compile(r"^\d+(-\d+)?(,\d+(-\d+)?)*$")


class PciAddressError(ValueError):
    pass


class PciAddress(NamedTuple):
    domain: int
    bus: int
    slot: int
    function: int

    def __str__(self) -> str:
        return f"{self.domain:04x}:{self.bus:02x}:{self.slot:02x}.{self.function:x}"


def parse_pci_address(text: str) -> PciAddress:
    """Parse a full PCI address `DDDD:BB:SS.F` (as in sysfs). The short `BB:SS.F` form is refused on purpose:
    a slot binding must not depend on an implied PCI domain."""
    if not isinstance(text, str):
        raise PciAddressError(f"PCI address must be a string like 0000:18:00.0, got {type(text).__name__}")
    raw = text.strip()
    match = _PCI.match(raw)
    if not match:
        hint = ""
        if re.match(r"^[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7]$", raw):
            hint = " (the PCI domain is missing: write 0000:" + raw + ")"
        elif re.match(r"^[0-9a-fA-F]{4}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-9a-fA-F]+$", raw):
            hint = " (PCI function must be 0-7)"
        raise PciAddressError(f"invalid PCI address {text!r}: expected DDDD:BB:SS.F, e.g. 0000:18:00.0{hint}")
    domain, bus, slot, function = (int(g, 16) for g in match.groups())
    if slot > 0x1F:
        raise PciAddressError(f"invalid PCI address {text!r}: slot {slot:#04x} is above 0x1f")
    return PciAddress(domain, bus, slot, function)


def parse_cpuset(text: str) -> list[int]:
    """Expand a libvirt/cpuset list such as `0-3,8,10-11` into sorted CPU ids."""
    raw = text.replace(" ", "")
    if not _CPUSET.match(raw):
        raise ValueError(f"invalid cpuset {text!r}: expected e.g. 0-23,96-119")
    cpus: set[int] = set()
    for part in raw.split(","):
        lo, _, hi = part.partition("-")
        start, end = int(lo), int(hi or lo)
        if end < start:
            raise ValueError(f"invalid cpuset {text!r}: range {part} is reversed")
        cpus.update(range(start, end + 1))
    return sorted(cpus)


def normalise_mac(text: str) -> str:
    mac = text.strip().lower().replace("-", ":")
    if not _MAC.match(mac):
        raise ValueError(f"invalid MAC address {text!r}: expected six colon-separated hex octets")
    if int(mac[:2], 16) & 1:
        raise ValueError(f"invalid MAC address {text!r}: multicast bit set")
    return mac


class SliceVmSpec(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    vm_name: str
    uuid: str
    vcpus: int = Field(ge=1, le=512)
    memory_mib: int = Field(ge=128)
    hugepages: bool = False
    numa_node: int | None = Field(default=None, ge=0)
    cpuset: str | None = None
    gpus: list[str] = Field(default_factory=list)
    fabric_vfs: list[str] = Field(default_factory=list)
    nvme_by_id: list[str] = Field(min_length=1)
    # None: a path under /dev is a block device, anything else a file stand-in (tests, simulated hosts).
    # Set explicitly when the caller has stat()ed the path.
    disk_source_type: Literal["block", "file"] | None = None
    seed_iso_path: str
    mac: str
    bridge: str = "ovsbr0"
    bridge_kind: Literal["openvswitch", "linux"] = "openvswitch"
    # kvm on GPU hosts; qemu (TCG) where KVM cannot run guests (the lab). Passthrough needs kvm.
    domain_type: Literal["kvm", "qemu"] = "kvm"
    loader_path: str = DEFAULT_LOADER_PATH
    nvram_template_path: str = DEFAULT_NVRAM_TEMPLATE_PATH
    # None lets libvirt place the per-domain VARS copy in its own nvram directory.
    nvram_path: str | None = None
    # Where the serial console's output is kept (the VM's boot and cloud-init messages); None keeps none.
    console_log_path: str | None = None

    @field_validator("vm_name")
    @classmethod
    def _vm_name(cls, v: str) -> str:
        if not _VM_NAME.match(v):
            raise ValueError(f"invalid vm_name {v!r}: 1-63 chars of letters, digits, '_', '.', '-'")
        return v

    @field_validator("uuid")
    @classmethod
    def _uuid(cls, v: str) -> str:
        try:
            return str(uuid_mod.UUID(str(v)))
        except ValueError:
            raise ValueError(f"invalid uuid {v!r}") from None

    @field_validator("numa_node", mode="before")
    @classmethod
    def _numa_node(cls, v: object) -> object:
        # sysfs reports -1 when the platform has no NUMA information: same as "no locality".
        if isinstance(v, int) and v == -1:
            return None
        return v

    @field_validator("cpuset")
    @classmethod
    def _cpuset(cls, v: str | None) -> str | None:
        if v is None:
            return None
        parse_cpuset(v)
        return v.replace(" ", "")

    @field_validator("gpus", "fabric_vfs")
    @classmethod
    def _pci_list(cls, v: list[str]) -> list[str]:
        out = [str(parse_pci_address(a)) for a in v]
        if len(set(out)) != len(out):
            raise ValueError(f"duplicate PCI address in {out}")
        return out

    @field_validator("nvme_by_id")
    @classmethod
    def _disks(cls, v: list[str]) -> list[str]:
        for path in v:
            if not path.startswith("/"):
                raise ValueError(f"disk path {path!r} must be absolute")
        if len(set(v)) != len(v):
            raise ValueError(f"duplicate disk path in {v}")
        if len(v) > 26:
            raise ValueError("at most 26 disks (vda..vdz)")
        return v

    @field_validator("seed_iso_path", "loader_path", "nvram_template_path", "nvram_path", "console_log_path")
    @classmethod
    def _abs_path(cls, v: str | None) -> str | None:
        if v is not None and not v.startswith("/"):
            raise ValueError(f"path {v!r} must be absolute")
        return v

    @field_validator("mac")
    @classmethod
    def _mac(cls, v: str) -> str:
        return normalise_mac(v)

    @field_validator("bridge")
    @classmethod
    def _bridge(cls, v: str) -> str:
        if not _BRIDGE.match(v):
            raise ValueError(f"invalid bridge name {v!r}")
        return v

    @model_validator(mode="after")
    def _passthrough_needs_kvm(self) -> SliceVmSpec:
        if self.domain_type != "kvm" and (self.gpus or self.fabric_vfs):
            raise ValueError("PCI passthrough (GPUs, fabric VFs) needs domain type kvm, not an emulated guest")
        return self

    def disk_type(self, path: str) -> Literal["block", "file"]:
        if self.disk_source_type is not None:
            return self.disk_source_type
        return "block" if path.startswith("/dev/") else "file"
