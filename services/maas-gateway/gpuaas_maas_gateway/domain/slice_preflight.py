"""Commissioning preflight: the `GPUAAS_SLICE_*` lines of `50-gpuaas-slice-firmware-preflight`, parsed and judged. Pure.

The runbook (slice-node-bootstrap, "Automation Artifacts") has the commissioning script read the
slice-critical BIOS settings, validate KVM/IOMMU/GPU/BF3/SR-IOV visibility, report NVMe whole devices
with stable by-id paths, child partitions, mountpoints, filesystem types and wipefs signatures, and
print `GPUAAS_SLICE_*` result lines. The runbook's only written grammar is the parity checker's
(`GPUAAS_SLICE_PARITY status=PASS check=node_agent detail=active/running`, values with backslash-escaped
spaces, an optional `remediation=`); the preflight lines use the same grammar:

    GPUAAS_SLICE_PREFLIGHT status=PASS|WARN|FAIL check=<name> detail=<text> [remediation=<text>]
    GPUAAS_SLICE_NVME by_id=/dev/disk/by-id/nvme-eui.… kernel=nvme0n1 os_disk=0 mounted=0 signatures=none
    GPUAAS_SLICE_NVME_CHILD parent=/dev/disk/by-id/nvme-eui.… name=nvme0n1p1 mountpoint=/share2 fstype=ext4
    GPUAAS_SLICE_PREFLIGHT_SUMMARY failures=0 warnings=0 mode=read-only

A host passes only when every required check reported PASS (or WARN), nothing FAILed, the summary
line is there and agrees, at least one NVMe device is reported by stable by-id identity, and the
script itself passed. Anything else fails, with every reason named.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

# The checks the commissioning script must report; each maps to a runbook condition.
REQUIRED_CHECKS: dict[str, str] = {
    "bios_proc_virtualization": "BIOS.ProcSettings.ProcVirtualization=Enabled (VT-x/VMX)",
    "bios_logical_proc": "BIOS.ProcSettings.LogicalProc=Enabled",
    "bios_sriov_global": "BIOS.IntegratedDevices.SriovGlobalEnable=Enabled",
    "kvm": "/dev/kvm present, VMX not disabled by BIOS",
    "iommu": "intel_iommu=on iommu=pt and non-empty IOMMU groups",
    "gpu": "H200 GPUs visible on PCI",
    "bf3": "BlueField-3 PFs visible",
    "sriov": "BF3 PF sriov_totalvfs > 0",
}
PREFIX = "GPUAAS_SLICE_"
STATUSES = ("PASS", "WARN", "FAIL")
# MAAS script result status names that mean the script ran to completion.
SCRIPT_PASSED = "Passed"

_TOKEN = re.compile(r"([a-z_][a-z0-9_]*)=((?:\\.|[^\s\\])*)")


class PreflightLineError(ValueError):
    pass


def split_fields(rest: str) -> dict[str, str]:
    """`k=v k2=a\\ b` -> {k: v, k2: "a b"}; anything that is not such a token is an error."""
    out: dict[str, str] = {}
    pos = 0
    rest = rest.strip()
    while pos < len(rest):
        if rest[pos].isspace():
            pos += 1
            continue
        match = _TOKEN.match(rest, pos)
        if match is None or (match.end() < len(rest) and not rest[match.end()].isspace()):
            raise PreflightLineError(f"not a key=value token at {rest[pos : pos + 40]!r}")
        key, value = match.group(1), re.sub(r"\\(.)", r"\1", match.group(2))
        if key in out:
            raise PreflightLineError(f"key {key!r} repeated")
        out[key] = value
        pos = match.end()
    return out


@dataclass(frozen=True)
class Check:
    check: str
    status: str
    detail: str = ""
    remediation: str = ""


@dataclass
class NvmeChild:
    name: str
    mountpoint: str = ""
    fstype: str = ""


@dataclass
class NvmeDevice:
    by_id: str
    kernel: str = ""
    os_disk: bool = False
    mounted: bool = False
    signatures: list[str] = field(default_factory=list)
    children: list[NvmeChild] = field(default_factory=list)


@dataclass
class Preflight:
    """What the output says; `verdict` judges it."""

    checks: list[Check] = field(default_factory=list)
    nvme: list[NvmeDevice] = field(default_factory=list)
    summary: dict[str, str] | None = None
    malformed: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Verdict:
    status: str  # passed | failed | missing
    reasons: tuple[str, ...]
    warnings: tuple[str, ...]


def _flag(value: str, line_no: int, key: str) -> bool:
    if value not in ("0", "1"):
        raise PreflightLineError(f"{key}={value!r} is not 0 or 1")
    return value == "1"


def parse(output: str) -> Preflight:
    """Every `GPUAAS_SLICE_*` line of the output; other lines (RACADM chatter, apt) are ignored."""
    result = Preflight()
    by_id: dict[str, NvmeDevice] = {}
    for line_no, raw in enumerate(output.splitlines(), start=1):
        line = raw.strip()
        if not line.startswith(PREFIX):
            continue
        kind, _, rest = line.partition(" ")
        try:
            fields = split_fields(rest)
            if kind == "GPUAAS_SLICE_PREFLIGHT":
                status, check = fields.get("status", ""), fields.get("check", "")
                if status not in STATUSES:
                    raise PreflightLineError(f"status={status!r} is not one of {'/'.join(STATUSES)}")
                if not check:
                    raise PreflightLineError("no check=")
                result.checks.append(Check(check, status, fields.get("detail", ""), fields.get("remediation", "")))
            elif kind == "GPUAAS_SLICE_NVME":
                device_id = fields.get("by_id", "")
                if not device_id:
                    raise PreflightLineError("no by_id=")
                sigs = fields.get("signatures", "none")
                device = NvmeDevice(
                    device_id,
                    fields.get("kernel", ""),
                    _flag(fields.get("os_disk", "0"), line_no, "os_disk"),
                    _flag(fields.get("mounted", "0"), line_no, "mounted"),
                    [] if sigs in ("", "none") else sigs.split(","),
                )
                by_id[device_id] = device
                result.nvme.append(device)
            elif kind == "GPUAAS_SLICE_NVME_CHILD":
                parent = by_id.get(fields.get("parent", ""))
                if parent is None:
                    raise PreflightLineError(f"child of unreported device {fields.get('parent', '')!r}")
                if not fields.get("name"):
                    raise PreflightLineError("no name=")
                parent.children.append(
                    NvmeChild(fields["name"], fields.get("mountpoint", ""), fields.get("fstype", ""))
                )
            elif kind == "GPUAAS_SLICE_PREFLIGHT_SUMMARY":
                for key in ("failures", "warnings"):
                    if not fields.get(key, "").isdigit():
                        raise PreflightLineError(f"{key}= is not a count")
                result.summary = fields
            else:
                continue  # another GPUAAS_SLICE_* family (e.g. PARITY) is not this script's
        except PreflightLineError as exc:
            result.malformed.append(f"line {line_no}: {exc}")
    return result


def verdict(pre: Preflight | None, *, script_status: str | None = None, exit_status: int | None = None) -> Verdict:
    """None (no result for the script in the commissioning run) is `missing`, never a pass."""
    if pre is None:
        return Verdict("missing", ("the commissioning run has no preflight script result",), ())
    reasons: list[str] = []
    warnings: list[str] = []
    if script_status is not None and script_status != SCRIPT_PASSED:
        reasons.append(f"preflight script result is {script_status}")
    if exit_status not in (None, 0):
        reasons.append(f"preflight script exited with {exit_status}")
    reasons.extend(f"malformed {m}" for m in pre.malformed)
    seen: dict[str, Check] = {}
    for check in pre.checks:
        if check.check in seen and seen[check.check].status != check.status:
            reasons.append(f"check {check.check} reported twice with different results")
        seen[check.check] = check
        text = f"{check.check}: {check.detail or 'no detail'}" + (
            f" (remediation: {check.remediation})" if check.remediation else ""
        )
        if check.status == "FAIL":
            reasons.append(text)
        elif check.status == "WARN":
            warnings.append(text)
    for name, meaning in REQUIRED_CHECKS.items():
        if name not in seen:
            reasons.append(f"check {name} not reported ({meaning})")
    if pre.summary is None:
        reasons.append("no GPUAAS_SLICE_PREFLIGHT_SUMMARY line: output truncated or the script stopped early")
    else:
        fails = sum(1 for c in seen.values() if c.status == "FAIL")
        if int(pre.summary["failures"]) != fails:
            reasons.append(f"summary says failures={pre.summary['failures']} but {fails} check(s) failed")
    if not pre.nvme:
        reasons.append("no NVMe device reported")
    for device in pre.nvme:
        if not device.by_id.startswith("/dev/disk/by-id/"):
            reasons.append(f"NVMe {device.by_id} is not a stable /dev/disk/by-id path")
        if device.os_disk:
            continue
        mounted = [c for c in device.children if c.mountpoint]
        if device.mounted or mounted:
            where = ", ".join(f"{c.name} on {c.mountpoint}" for c in mounted) or "the device itself"
            warnings.append(f"NVMe {device.by_id} is mounted ({where}): not a raw slice disk until infra remaps it")
        elif device.signatures:
            warnings.append(f"NVMe {device.by_id} carries signatures {','.join(device.signatures)}")
    return Verdict("failed" if reasons else "passed", tuple(reasons), tuple(warnings))
