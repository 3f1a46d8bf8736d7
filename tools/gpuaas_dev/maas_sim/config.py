"""Configuration of one simulator instance."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .auth import ApiKey, generate_api_key
from .machines import Timers, system_id_for

UBUNTU_SERIES = ("focal", "jammy", "noble")
DEFAULT_CUSTOM_IMAGES = ("gpuaas-h200-host-ubuntu2404",)
# A release flag left out takes MAAS's global setting of that name; a fresh MAAS has every one off.
ERASE_SETTINGS = {
    "enable_disk_erasing_on_release": False,
    "disk_erase_with_secure_erase": False,
    "disk_erase_with_quick_erase": False,
}
RELEASE_FLAG_SETTINGS = {
    "erase": "enable_disk_erasing_on_release",
    "secure_erase": "disk_erase_with_secure_erase",
    "quick_erase": "disk_erase_with_quick_erase",
}


@dataclass(frozen=True)
class MachineSpec:
    hostname: str
    system_id: str | None = None
    tags: tuple[str, ...] = ()
    # Whether the machine's drives have a secure erase of their own.
    secure_erase: bool = True

    @property
    def resolved_system_id(self) -> str:
        return self.system_id or system_id_for(self.hostname)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MachineSpec:
        return cls(
            hostname=str(data["hostname"]),
            system_id=data.get("system_id") or None,
            tags=tuple(data.get("tags") or ()),
            secure_erase=bool(data.get("secure_erase", True)),
        )


@dataclass
class SimConfig:
    """`machines` is a count (hostnames bm-01…) or explicit specs; every machine starts Ready.

    `api_key` is the one key MAAS will accept; a fresh one is generated when omitted, so a
    simulator never runs with a well-known key. `clock` drives the machine timers and can be
    replaced in tests; `wall_clock` is only for OAuth timestamps.
    """

    machines: int | Sequence[MachineSpec | dict[str, Any]] = 4
    api_key: ApiKey | str | None = None
    timers: Timers = field(default_factory=Timers)
    ubuntu_series: tuple[str, ...] = UBUNTU_SERIES
    default_distro_series: str = "noble"
    # None accepts any `custom/<name>`: boot resources are not simulated yet.
    custom_images: tuple[str, ...] | None = DEFAULT_CUSTOM_IMAGES
    seed: int = 0
    maas_version: str = "3.5.4"
    owner: str = "admin"
    # MAAS's global settings a release reads for each erase flag it is not given (all off in a fresh MAAS);
    # `maas/?op=set_config` changes them as on a real region.
    erase_settings: dict[str, bool] = field(default_factory=lambda: dict(ERASE_SETTINGS))
    clock: Callable[[], float] = time.monotonic
    wall_clock: Callable[[], float] = time.time

    def __post_init__(self) -> None:
        if self.api_key is None:
            self.api_key = generate_api_key()
        elif isinstance(self.api_key, str):
            self.api_key = ApiKey.parse(self.api_key)

    @property
    def key(self) -> ApiKey:
        assert isinstance(self.api_key, ApiKey)
        return self.api_key

    def machine_specs(self) -> list[MachineSpec]:
        if isinstance(self.machines, int):
            width = max(2, len(str(self.machines)))
            return [MachineSpec(hostname=f"bm-{i:0{width}d}") for i in range(1, self.machines + 1)]
        return [m if isinstance(m, MachineSpec) else MachineSpec.from_dict(m) for m in self.machines]

    @classmethod
    def from_cli(
        cls,
        machines: int = 4,
        api_key: str | None = None,
        machines_file: str | Path | None = None,
        deploy_seconds: float | None = None,
        release_seconds: float | None = None,
        erase_seconds: float | None = None,
        commission_seconds: float | None = None,
        testing_seconds: float | None = None,
        seed: int = 0,
        custom_images: Sequence[str] | None = None,
    ) -> SimConfig:
        """Build a config from CLI flags; `machines_file` is a JSON list of {system_id?, hostname, tags}."""
        specs: int | list[MachineSpec] = machines
        if machines_file is not None:
            raw = json.loads(Path(machines_file).read_text(encoding="utf-8"))
            specs = [MachineSpec.from_dict(m) for m in raw]
        changes = {
            name: value
            for name, value in (
                ("deploying", deploy_seconds),
                ("releasing", release_seconds),
                ("disk_erasing", erase_seconds),
                ("commissioning", commission_seconds),
                ("testing", testing_seconds),
            )
            if value is not None
        }
        return cls(
            machines=specs,
            api_key=api_key,
            timers=Timers().updated(**changes),
            seed=seed,
            custom_images=tuple(custom_images) if custom_images is not None else DEFAULT_CUSTOM_IMAGES,
        )
