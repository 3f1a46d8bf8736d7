"""The guest's GPU check: what the image's readiness unit reported against what the slot group passed through.

A slice whose guest cannot use its GPUs must not go active (slice-implementation-checklist: readiness includes
the guest's GPU check). The report is the JSON the image's `guest-gpu-report` writes (version 1); the image
pipeline owns the writer, this module only reads it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from gpuaas_common.contract import messages as m

# Where the image's readiness unit writes the report; the agent's login reads it from there.
GUEST_GPU_FILE = "/run/gpuaas/guest-gpus.json"
REPORT_MAX_BYTES = 64 * 1024


class _Loose(BaseModel):
    # The guest may say more in a later version of its script; what is read here must be there.
    model_config = ConfigDict(extra="ignore", frozen=True)


class PciGpu(_Loose):
    address: str = Field(max_length=64)
    driver: str | None = Field(default=None, max_length=64)


class Driver(_Loose):
    state: Literal["loaded", "absent", "failed"]
    version: str | None = Field(default=None, max_length=64)
    detail: str | None = Field(default=None, max_length=1000)


class SmiGpu(_Loose):
    bus_id: str | None = Field(default=None, max_length=64)
    name: str | None = Field(default=None, max_length=200)


class GuestGpuReport(_Loose):
    version: Literal[1]
    pci_gpus: list[PciGpu] = Field(max_length=64)
    driver: Driver
    nvidia_smi_gpus: list[SmiGpu] | None = Field(default=None, max_length=64)


class ReportInvalid(ValueError):
    pass


def parse_report(text: str) -> GuestGpuReport:
    if len(text.encode()) > REPORT_MAX_BYTES:
        raise ReportInvalid(f"the guest's GPU report is larger than {REPORT_MAX_BYTES} bytes")
    try:
        return GuestGpuReport.model_validate(json.loads(text))
    except (ValueError, ValidationError) as exc:
        why = " ".join(str(exc).splitlines()[:3])[:300]
        raise ReportInvalid(f"the guest's GPU report is not one this agent reads: {why}") from None


@dataclass(frozen=True)
class Verdict:
    evidence: m.GuestGpus
    code: str | None = None  # None: the guest sees what it was given
    reason: str | None = None


def judge(report: GuestGpuReport, expected: int, strategy: m.DriverStrategy) -> Verdict:
    """Every GPU passed through must be on the guest's PCI bus, and nvidia-smi, when it answers, must list each.
    A preinstalled image's guest must also have a working driver for them; a cloud_init image's driver is the
    tenant's first boot's to install, so its state is evidence only."""
    pci = len(report.pci_gpus)
    driver = len(report.nvidia_smi_gpus or []) if report.driver.state == "loaded" else None
    evidence = m.GuestGpus(
        expected=expected,
        pci=pci,
        driver=driver,
        driver_state=report.driver.state,
        driver_version=report.driver.version,
        driver_strategy=strategy,
    )
    if pci != expected:
        return Verdict(
            evidence,
            "guest_gpu_mismatch",
            f"the slot group passes {expected} GPU(s) through; the guest sees {pci} on its PCI bus"
            + (f" ({', '.join(g.address for g in report.pci_gpus)})" if report.pci_gpus else ""),
        )
    if driver is not None and driver != expected:
        return Verdict(
            evidence,
            "guest_gpu_mismatch",
            f"the slot group passes {expected} GPU(s) through; nvidia-smi in the guest lists {driver} "
            f"(driver {report.driver.version or 'of unknown version'})",
        )
    if expected and strategy == "preinstalled" and report.driver.state != "loaded":
        return Verdict(
            evidence,
            "guest_gpu_driver_missing",
            f"the image's driver is preinstalled, but in the guest nvidia-smi is {report.driver.state}"
            + (f": {report.driver.detail}" if report.driver.detail else ""),
        )
    return Verdict(evidence)
