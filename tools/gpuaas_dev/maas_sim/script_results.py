"""Commissioning script results as MAAS stores and serves them. Pure: no HTTP.

Every commissioning run makes a result set (ids global across machines, like MAAS's ScriptSet) with one
result per script, sorted by name: the builtin commissioning scripts plus every uploaded commissioning
script (all of them when the run named none, else the named ones). Outputs are served base64
(`output` combined, `stdout`, `stderr`, `result`) with `include_output`. The slice firmware preflight
(`50-gpuaas-slice-firmware-preflight`) prints the machine's `GPUAAS_SLICE_*` lines: a healthy H200
slice host by default, or what a test set with `Machine.preflight_failures` / `preflight_output`.
"""

from __future__ import annotations

import base64
import hashlib
import itertools
from dataclasses import dataclass, field
from email.utils import formatdate
from typing import Any

from .errors import BadRequest, NotFound

PREFLIGHT_SCRIPT = "50-gpuaas-slice-firmware-preflight"
# Builtins a MAAS 3.5 commissioning run always has (a subset: enough for a client to skip them).
BUILTIN_COMMISSIONING = ("00-maas-00-support-info", "50-maas-01-commissioning", "maas-lshw")
STATUS_NAMES = {0: "Pending", 1: "Running", 2: "Passed", 3: "Failed", 4: "Timed out", 5: "Aborted"}
RESULT_TYPES = {
    "commissioning": 0,
    "commission": 0,
    "installation": 1,
    "install": 1,
    "testing": 2,
    "test": 2,
    "release": 3,
    "0": 0,
    "1": 1,
    "2": 2,
    "3": 3,
}
TYPE_NAMES = {0: "Commissioning", 1: "Installation", 2: "Testing", 3: "Release"}
HARDWARE_TYPES = {
    "node": 0,
    "cpu": 1,
    "memory": 2,
    "storage": 3,
    "network": 4,
    "gpu": 5,
    "0": 0,
    "1": 1,
    "2": 2,
    "3": 3,
    "4": 4,
    "5": 5,
}

# check -> (detail when passing, detail when failing, remediation)
PREFLIGHT_CHECKS: dict[str, tuple[str, str, str]] = {
    "bios_proc_virtualization": (
        "ProcVirtualization=Enabled",
        "ProcVirtualization=Disabled",
        "racadm set BIOS.ProcSettings.ProcVirtualization Enabled",
    ),
    "bios_logical_proc": (
        "LogicalProc=Enabled",
        "LogicalProc=Disabled",
        "racadm set BIOS.ProcSettings.LogicalProc Enabled",
    ),
    "bios_sriov_global": (
        "SriovGlobalEnable=Enabled",
        "SriovGlobalEnable=Disabled",
        "racadm set BIOS.IntegratedDevices.SriovGlobalEnable Enabled",
    ),
    "kvm": ("kvm=present", "kvm=missing VMX (outside TXT) disabled by BIOS", "enable VT-x/VMX in firmware"),
    "iommu": (
        "cmdline=intel_iommu=on iommu=pt iommu_groups=510",
        "iommu_groups=0",
        "enable VT-d and stage intel_iommu=on iommu=pt",
    ),
    "gpu": ("gpus=8 model=H200", "gpus=0", "check GPU seating and PCIe visibility"),
    "bf3": ("pfs=0000:bc:00.0,0000:bc:00.1", "pfs=none", "check BlueField-3 visibility"),
    "sriov": ("0000:bc:00.0 sriov_totalvfs=16 sriov_numvfs=0", "sriov_totalvfs=0", "enable SR-IOV on the BF3 PFs"),
}


def _esc(text: str) -> str:
    return text.replace("\\", "\\\\").replace(" ", "\\ ")


def preflight_output(hostname: str, failures: dict[str, str] | None = None, nvme_devices: int = 8) -> str:
    """The script's stdout for a healthy H200 slice host, with the named checks failing instead."""
    failures = failures or {}
    lines = ["Reading BIOS settings with racadm (read-only)"]
    for check, (ok, bad, fix) in PREFLIGHT_CHECKS.items():
        if check in failures:
            detail = failures[check] or bad
            lines.append(
                f"GPUAAS_SLICE_PREFLIGHT status=FAIL check={check} detail={_esc(detail)} remediation={_esc(fix)}"
            )
        else:
            lines.append(f"GPUAAS_SLICE_PREFLIGHT status=PASS check={check} detail={_esc(ok)}")
    for n in range(nvme_devices + 1):
        eui = hashlib.sha256(f"{hostname}:nvme{n}".encode()).hexdigest()[:32]
        os_disk = n == nvme_devices
        lines.append(
            f"GPUAAS_SLICE_NVME by_id=/dev/disk/by-id/nvme-eui.{eui} kernel=nvme{n}n1 "
            f"os_disk={int(os_disk)} mounted=0 signatures={'gpt' if os_disk else 'none'}"
        )
        if os_disk:
            lines.append(
                f"GPUAAS_SLICE_NVME_CHILD parent=/dev/disk/by-id/nvme-eui.{eui} name=nvme{n}n1p2 "
                "mountpoint=/ fstype=ext4"
            )
    lines.append(f"GPUAAS_SLICE_PREFLIGHT_SUMMARY failures={len(failures)} warnings=0 mode=read-only")
    return "\n".join(lines) + "\n"


def _b64(text: str) -> str:
    return base64.b64encode(text.encode("utf-8")).decode("ascii")


@dataclass
class ScriptResult:
    id: int
    name: str
    script_id: int | None
    stdout: str = ""
    stderr: str = ""
    exit_status: int = 0

    def to_json(self, running: bool, started: float, ended: float, include_output: bool) -> dict[str, Any]:
        status = 1 if running else (2 if self.exit_status == 0 else 3)
        out: dict[str, Any] = {
            "id": self.id,
            "created": formatdate(started),
            "updated": formatdate(ended if not running else started),
            "name": self.name,
            "status": status,
            "status_name": STATUS_NAMES[status],
            "exit_status": None if running else self.exit_status,
            "started": formatdate(started),
            "ended": None if running else formatdate(ended),
            "runtime": "" if running else "0:00:01",
            "starttime": started,
            "endtime": "" if running else ended,
            "estimated_runtime": "0:00:01",
            "parameters": {},
            "script_id": self.script_id,
            "script_revision_id": self.script_id,
            "suppressed": False,
        }
        if include_output:
            combined = self.stdout + self.stderr
            out.update(output=_b64(combined), stdout=_b64(self.stdout), stderr=_b64(self.stderr), result=_b64(""))
        return out


@dataclass
class ResultSet:
    id: int
    system_id: str
    result_type: int
    started: float  # wall clock
    results: list[ScriptResult] = field(default_factory=list)
    running: bool = True
    ended: float | None = None

    def to_json(self, api_root: str, include_output: bool, filters: tuple[str, ...] = ()) -> dict[str, Any]:
        results = sorted(self.results, key=lambda r: r.name)
        if filters:
            results = [r for r in results if r.name in filters or str(r.id) in filters]
        ended = self.ended if self.ended is not None else self.started
        if self.running:
            status = 1
        elif any(r.exit_status != 0 for r in self.results):
            status = 3
        else:
            status = 2 if self.results else -1
        return {
            "id": self.id,
            "system_id": self.system_id,
            "type": self.result_type,
            "type_name": TYPE_NAMES[self.result_type],
            "last_ping": formatdate(ended),
            "status": status,
            "status_name": {1: "Running", 2: "Passed", 3: "Failed", -1: "Unknown"}[status],
            "started": formatdate(self.started),
            "ended": None if self.running else formatdate(ended),
            "runtime": "" if self.running else "0:00:02",
            "resource_uri": f"{api_root}nodes/{self.system_id}/results/{self.id}/",
            "results": [r.to_json(self.running, self.started, ended, include_output) for r in results],
        }


class ResultStore:
    def __init__(self) -> None:
        self.sets: dict[int, ResultSet] = {}
        self._set_ids = itertools.count(1)
        self._result_ids = itertools.count(1)

    def new_set(self, system_id: str, result_type: int, started: float) -> ResultSet:
        rset = ResultSet(next(self._set_ids), system_id, result_type, started)
        self.sets[rset.id] = rset
        return rset

    def add(self, rset: ResultSet, name: str, script_id: int | None, stdout: str = "", exit_status: int = 0) -> None:
        rset.results.append(ScriptResult(next(self._result_ids), name, script_id, stdout, "", exit_status))

    def for_node(self, system_id: str) -> list[ResultSet]:
        return [s for s in self.sets.values() if s.system_id == system_id]

    def get(self, system_id: str, set_id: str, current: dict[str, int | None]) -> ResultSet:
        if set_id.startswith("current-"):
            if set_id not in current or current[set_id] is None:
                raise BadRequest(_unknown_id(set_id))
            wanted = current[set_id]
        else:
            try:
                wanted = int(set_id)
            except ValueError:
                raise BadRequest(_unknown_id(set_id)) from None
        rset = self.sets.get(wanted or -1)
        if rset is None or rset.system_id != system_id:
            raise NotFound("No ScriptSet matches the given query.")
        return rset


def _unknown_id(set_id: str) -> str:
    return (
        f'Unknown id "{set_id}" must be current-commissioning, current-testing, current-installation, '
        "or the id number of a specific result."
    )
