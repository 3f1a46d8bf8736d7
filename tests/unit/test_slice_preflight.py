"""Commissioning preflight: each GPUAAS_SLICE_* rule with a violating fixture (runbook slice-node-bootstrap,
"Automation Artifacts" and "Infra Bootstrap Target")."""

from __future__ import annotations

import pytest

from gpuaas_dev.maas_sim.script_results import preflight_output
from gpuaas_maas_gateway.domain import slice_preflight as pre

GOOD = preflight_output("slice-01")


def judge(text: str, **kw: object) -> pre.Verdict:
    return pre.verdict(pre.parse(text), **kw)  # type: ignore[arg-type]


def without(check: str) -> str:
    return "\n".join(line for line in GOOD.splitlines() if f"check={check} " not in line)


def replace(old: str, new: str) -> str:
    assert old in GOOD
    return GOOD.replace(old, new)


def test_healthy_output_passes_and_is_parsed_whole() -> None:
    parsed = pre.parse(GOOD)
    assert {c.check for c in parsed.checks} == set(pre.REQUIRED_CHECKS)
    assert len(parsed.nvme) == 9 and sum(d.os_disk for d in parsed.nvme) == 1
    assert parsed.nvme[-1].children[0].mountpoint == "/"
    assert judge(GOOD, script_status="Passed", exit_status=0) == pre.Verdict("passed", (), ())


def test_runbook_grammar_escaped_spaces_and_remediation() -> None:
    line = (
        "GPUAAS_SLICE_PREFLIGHT status=FAIL check=iommu detail=command\\ exited\\ with\\ 1 "
        "remediation=stage\\ intel_iommu=on\\ iommu=pt"
    )
    (check,) = pre.parse(line).checks
    assert check == pre.Check("iommu", "FAIL", "command exited with 1", "stage intel_iommu=on iommu=pt")


FAILING = [
    # (case, output, verdict kwargs, expected reason fragment)
    (
        "bios_vmx_disabled",
        replace(
            "status=PASS check=bios_proc_virtualization detail=ProcVirtualization=Enabled",
            "status=FAIL check=bios_proc_virtualization detail=ProcVirtualization=Disabled",
        ).replace("failures=0", "failures=1"),
        {},
        "bios_proc_virtualization: ProcVirtualization=Disabled",
    ),
    (
        "kvm_missing",
        replace("status=PASS check=kvm detail=kvm=present", "status=FAIL check=kvm detail=kvm=missing").replace(
            "failures=0", "failures=1"
        ),
        {},
        "kvm: kvm=missing",
    ),
    ("iommu_not_reported", without("iommu"), {}, "check iommu not reported"),
    ("gpu_not_reported", without("gpu"), {}, "check gpu not reported"),
    ("bf3_not_reported", without("bf3"), {}, "check bf3 not reported"),
    ("sriov_not_reported", without("sriov"), {}, "check sriov not reported"),
    ("sriov_global_not_reported", without("bios_sriov_global"), {}, "check bios_sriov_global not reported"),
    (
        "summary_missing",
        "\n".join(x for x in GOOD.splitlines() if "SUMMARY" not in x),
        {},
        "no GPUAAS_SLICE_PREFLIGHT_SUMMARY",
    ),
    ("summary_disagrees", replace("failures=0", "failures=2"), {}, "summary says failures=2"),
    ("no_nvme", "\n".join(x for x in GOOD.splitlines() if "_NVME" not in x), {}, "no NVMe device reported"),
    (
        "nvme_volatile_path",
        GOOD.replace("by_id=/dev/disk/by-id/", "by_id=/dev/", 1).replace(
            "parent=/dev/disk/by-id/", "parent=/dev/disk/by-id/", 1
        ),
        {},
        "is not a stable /dev/disk/by-id path",
    ),
    ("malformed_status", replace("status=PASS check=gpu", "status=OK check=gpu"), {}, "malformed line"),
    (
        "malformed_token",
        replace("check=gpu detail=gpus=8\\ model=H200", "check=gpu detail=gpus=8 model H200"),
        {},
        "malformed line",
    ),
    (
        "child_of_unknown_device",
        GOOD + "GPUAAS_SLICE_NVME_CHILD parent=/dev/disk/by-id/nope name=x\n",
        {},
        "child of unreported device",
    ),
    ("bad_flag", GOOD.replace("os_disk=0", "os_disk=yes", 1), {}, "is not 0 or 1"),
    ("script_failed", GOOD, {"script_status": "Failed", "exit_status": 1}, "preflight script result is Failed"),
    ("script_timed_out", GOOD, {"script_status": "Timed out"}, "preflight script result is Timed out"),
    ("exit_nonzero", GOOD, {"exit_status": 2}, "exited with 2"),
    ("conflicting_repeat", GOOD + "GPUAAS_SLICE_PREFLIGHT status=FAIL check=kvm detail=gone\n", {}, "reported twice"),
    ("empty_output", "", {}, "check bios_proc_virtualization not reported"),
]


@pytest.mark.parametrize(("case", "text", "kw", "reason"), FAILING, ids=[c[0] for c in FAILING])
def test_each_failure_mode_fails_with_a_named_reason(case: str, text: str, kw: dict, reason: str) -> None:
    judged = judge(text, **kw)
    assert judged.status == "failed", case
    assert any(reason in r for r in judged.reasons), judged.reasons


def test_no_result_for_the_script_is_missing_not_passed() -> None:
    assert pre.verdict(None).status == "missing"


WARNINGS = [
    (
        "mounted_child",
        GOOD.replace("mounted=0 signatures=none", "mounted=0 signatures=none", 1) + "",
        "GPUAAS_SLICE_NVME_CHILD parent={by_id} name=nvme0n1p1 mountpoint=/share2 fstype=ext4",
        "is mounted",
    ),
    (
        "signatures",
        GOOD.replace("os_disk=0 mounted=0 signatures=none", "os_disk=0 mounted=0 signatures=gpt,ext4", 1),
        "",
        "carries signatures gpt,ext4",
    ),
    ("warn_check", replace("status=PASS check=bf3", "status=WARN check=bf3"), "", "bf3:"),
]


@pytest.mark.parametrize(("case", "text", "extra", "warning"), WARNINGS, ids=[w[0] for w in WARNINGS])
def test_storage_and_warn_evidence_is_reported_without_failing(case: str, text: str, extra: str, warning: str) -> None:
    if extra:
        text += extra.format(by_id=pre.parse(GOOD).nvme[0].by_id) + "\n"
    judged = judge(text)
    assert judged.status == "passed", judged.reasons
    assert any(warning in w for w in judged.warnings), judged.warnings


def test_other_gpuaas_lines_and_chatter_are_ignored() -> None:
    text = "apt-get install srvadmin-idracadm8\nGPUAAS_SLICE_PARITY status=FAIL check=x detail=y\n" + GOOD
    assert judge(text).status == "passed"
