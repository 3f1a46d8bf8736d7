"""Typed views of MAAS machine JSON for the gateway (independent of the simulator's own enum)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any


class MachineStatus(enum.IntEnum):
    NEW = 0
    COMMISSIONING = 1
    FAILED_COMMISSIONING = 2
    MISSING = 3
    READY = 4
    RESERVED = 5
    DEPLOYED = 6
    RETIRED = 7
    BROKEN = 8
    DEPLOYING = 9
    ALLOCATED = 10
    FAILED_DEPLOYMENT = 11
    RELEASING = 12
    FAILED_RELEASING = 13
    DISK_ERASING = 14
    FAILED_DISK_ERASING = 15
    RESCUE_MODE = 16
    ENTERING_RESCUE_MODE = 17
    FAILED_ENTERING_RESCUE_MODE = 18
    EXITING_RESCUE_MODE = 19
    FAILED_EXITING_RESCUE_MODE = 20
    TESTING = 21
    FAILED_TESTING = 22
    UNKNOWN = -1

    @classmethod
    def _missing_(cls, value: object) -> MachineStatus:
        # A newer MAAS may add states; an unknown one must not crash the poller.
        return cls.UNKNOWN


@dataclass(frozen=True)
class Machine:
    system_id: str
    hostname: str
    status: MachineStatus
    status_name: str
    status_message: str = ""
    owner: str | None = None
    osystem: str = ""
    distro_series: str = ""
    hwe_kernel: str | None = None
    power_state: str = "unknown"
    power_type: str = ""
    tag_names: tuple[str, ...] = ()
    ip_addresses: tuple[str, ...] = ()
    architecture: str = ""
    cpu_count: int = 0
    memory: int = 0
    zone: str = ""
    pool: str = ""
    locked: bool = False
    fqdn: str = ""
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Machine:
        def name_of(value: Any) -> str:
            if isinstance(value, dict):
                return str(value.get("name", ""))
            return str(value or "")

        return cls(
            system_id=str(data["system_id"]),
            hostname=str(data.get("hostname", "")),
            status=MachineStatus(int(data.get("status", -1))),
            status_name=str(data.get("status_name", "")),
            status_message=str(data.get("status_message") or ""),
            owner=data.get("owner"),
            osystem=str(data.get("osystem") or ""),
            distro_series=str(data.get("distro_series") or ""),
            hwe_kernel=data.get("hwe_kernel"),
            power_state=str(data.get("power_state") or "unknown"),
            power_type=str(data.get("power_type") or ""),
            tag_names=tuple(data.get("tag_names") or ()),
            ip_addresses=tuple(data.get("ip_addresses") or ()),
            architecture=str(data.get("architecture") or ""),
            cpu_count=int(data.get("cpu_count") or 0),
            memory=int(data.get("memory") or 0),
            zone=name_of(data.get("zone")),
            pool=name_of(data.get("pool")),
            locked=bool(data.get("locked", False)),
            fqdn=str(data.get("fqdn") or ""),
            raw=dict(data),
        )
