"""The guest GPU check from both ends: the image's report script run as the guest runs it (standalone python3,
against the sysfs and nvidia-smi output captured in a real H200 passthrough guest), and the agent's reading and
judging of what it wrote against the slot group."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gpuaas_image_pipeline.adapters import customise_chroot
from gpuaas_image_pipeline.guest import gpu_report
from gpuaas_node_agent.adapters import guest_ssh
from gpuaas_node_agent.domain.guest_gpus import GUEST_GPU_FILE, ReportInvalid, judge, parse_report

CAPTURED = Path(__file__).parents[1] / "fixtures/gpu_hosts/h200-passthrough-guest"
H200_UUID = "GPU-2074c71c-e5b5-0747-9431-fbdfc746e448"


def _pci_device(sys_root: Path, address: str, files: dict[str, str], driver: str | None) -> None:
    dev = sys_root / "bus/pci/devices" / address
    dev.mkdir(parents=True)
    for name, value in files.items():
        (dev / name).write_text(value + "\n")
    if driver:
        (sys_root / "bus/pci/drivers" / driver).mkdir(parents=True, exist_ok=True)
        (dev / "driver").symlink_to(f"../../../bus/pci/drivers/{driver}")


def _captured_guest_sysfs(sys_root: Path) -> None:
    """The captured guest's one H200 (its sysfs files as read there; the capture wrote the driver link's name)."""
    src = CAPTURED / "sysfs/0000_00_06.0"
    files = {name: (src / name).read_text().strip() for name in ("vendor", "device", "class")}
    _pci_device(sys_root, "0000:00:06.0", files, (src / "driver").read_text().strip())


def _tool(path: Path, body: str) -> Path:
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return path


def _run_in_guest(tmp_path: Path, sys_root: Path, nvidia_smi: Path) -> dict:
    """The script as the image gets it, from a directory of its own, with an interpreter that sees no site
    packages: what a guest without gpuaas has."""
    guest = tmp_path / "guest"
    guest.mkdir(exist_ok=True)
    script = guest / "guest-gpu-report"
    script.write_text(customise_chroot.gpu_report_source())
    out = guest / "run/gpuaas/guest-gpus.json"
    subprocess.run(
        [sys.executable, "-I", "-S", str(script), "--sys-root", str(sys_root), "--nvidia-smi", str(nvidia_smi),
         "--out", str(out)],
        check=True, cwd=guest, capture_output=True, text=True,
    )  # fmt: skip
    assert not out.with_name(out.name + ".tmp").exists()
    return json.loads(out.read_text())


def test_the_captured_h200_guest_reports_its_gpu_and_driver(tmp_path: Path) -> None:
    sys_root = tmp_path / "sys"
    _captured_guest_sysfs(sys_root)
    smi = _tool(tmp_path / "nvidia-smi", f'[ "$1 $2" = "-q -x" ] || exit 2\ncat "{CAPTURED / "nvidia-smi-q.xml"}"\n')

    report = _run_in_guest(tmp_path, sys_root, smi)

    assert report == {
        "version": 1,
        "pci_gpus": [{"address": "0000:00:06.0", "device": "0x2335", "driver": "nvidia"}],
        "driver": {"state": "loaded", "version": "580.159.04", "detail": None},
        "nvidia_smi_gpus": [{"bus_id": "00000000:00:06.0", "name": "NVIDIA H200", "uuid": H200_UUID}],
    }
    # nvidia-smi -L of the same guest names the same one GPU.
    assert (CAPTURED / "nvidia-smi-list.txt").read_text().count(f"(UUID: {H200_UUID})") == 1

    read = parse_report(json.dumps(report))
    ok = judge(read, 1, "preinstalled")
    assert ok.code is None
    assert ok.evidence.model_dump() == {
        "expected": 1,
        "pci": 1,
        "driver": 1,
        "driver_state": "loaded",
        "driver_version": "580.159.04",
        "driver_strategy": "preinstalled",
    }
    # Placed as a 2-GPU slice, the same guest is one GPU short.
    short = judge(read, 2, "preinstalled")
    assert short.code == "guest_gpu_mismatch"
    assert short.reason == "the slot group passes 2 GPU(s) through; the guest sees 1 on its PCI bus (0000:00:06.0)"


def test_without_nvidia_smi_the_pci_bus_counts_and_the_strategy_decides(tmp_path: Path) -> None:
    sys_root = tmp_path / "sys"
    _captured_guest_sysfs(sys_root)
    # Neither a VGA-class NVIDIA function nor a ConnectX VF is a GPU this cloud passes through.
    _pci_device(sys_root, "0000:00:07.0", {"vendor": "0x10de", "device": "0x1eb8", "class": "0x030000"}, None)
    _pci_device(sys_root, "0000:00:08.0", {"vendor": "0x15b3", "device": "0x101e", "class": "0x020700"}, "mlx5_core")

    report = _run_in_guest(tmp_path, sys_root, tmp_path / "no-such-nvidia-smi")

    assert report["driver"] == {"state": "absent", "version": None, "detail": "nvidia-smi is not installed"}
    assert report["nvidia_smi_gpus"] is None
    assert [g["address"] for g in report["pci_gpus"]] == ["0000:00:06.0"]
    read = parse_report(json.dumps(report))
    missing = judge(read, 1, "preinstalled")
    assert (missing.code, missing.reason) == (
        "guest_gpu_driver_missing",
        "the image's driver is preinstalled, but in the guest nvidia-smi is absent: nvidia-smi is not installed",
    )
    # A cloud_init image's driver is the tenant's first boot's to install: its GPU on the bus is enough.
    later = judge(read, 1, "cloud_init")
    assert later.code is None and later.evidence.driver is None and later.evidence.driver_state == "absent"


def test_an_nvidia_smi_that_cannot_reach_its_driver_is_a_failed_driver(tmp_path: Path) -> None:
    sys_root = tmp_path / "sys"
    _captured_guest_sysfs(sys_root)
    words = "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver."
    smi = _tool(tmp_path / "nvidia-smi", f'echo "{words}"\nexit 9\n')

    report = _run_in_guest(tmp_path, sys_root, smi)

    assert report["driver"] == {"state": "failed", "version": None, "detail": f"nvidia-smi exited 9: {words}"}
    verdict = judge(parse_report(json.dumps(report)), 1, "preinstalled")
    assert verdict.code == "guest_gpu_driver_missing" and words in (verdict.reason or "")


def test_nvidia_smi_listing_fewer_gpus_than_the_bus_is_a_mismatch() -> None:
    report = gpu_report.build_report(
        [{"address": f"0000:00:0{i}.0", "device": "0x2335", "driver": "nvidia"} for i in (6, 7)],
        {"state": "loaded", "version": "580.159.04", "detail": None},
        [{"bus_id": "00000000:00:06.0", "name": "NVIDIA H200", "uuid": H200_UUID}],
    )
    verdict = judge(parse_report(json.dumps(report)), 2, "cloud_init")
    assert (verdict.code, verdict.reason) == (
        "guest_gpu_mismatch",
        "the slot group passes 2 GPU(s) through; nvidia-smi in the guest lists 1 (driver 580.159.04)",
    )


def test_a_lab_guest_expects_no_gpu_and_sees_none(tmp_path: Path) -> None:
    """The lab's slots pass no GPU through (its topology has none): a guest without GPUs or driver is right."""
    sys_root = tmp_path / "sys"
    _pci_device(sys_root, "0000:00:01.0", {"vendor": "0x1af4", "device": "0x1041", "class": "0x020000"}, None)
    report = _run_in_guest(tmp_path, sys_root, tmp_path / "no-such-nvidia-smi")
    assert report["pci_gpus"] == []
    assert judge(parse_report(json.dumps(report)), 0, "preinstalled").code is None
    # A GPU the lab never passed through would be a mismatch too.
    _captured_guest_sysfs(sys_root)
    extra = _run_in_guest(tmp_path, sys_root, tmp_path / "no-such-nvidia-smi")
    assert judge(parse_report(json.dumps(extra)), 0, "preinstalled").code == "guest_gpu_mismatch"


@pytest.mark.parametrize(
    "text",
    [
        "",
        "not json",
        json.dumps({"version": 2, "pci_gpus": [], "driver": {"state": "absent"}}),
        json.dumps({"version": 1, "pci_gpus": [], "driver": {"state": "sleeping"}}),
        json.dumps({"version": 1, "driver": {"state": "absent"}}),
        "x" * (70 * 1024),
    ],
)
def test_a_report_the_agent_cannot_read_is_refused(text: str) -> None:
    with pytest.raises(ReportInvalid):
        parse_report(text)


def test_the_image_installs_the_script_and_the_unit_runs_it_where_the_login_reads(tmp_path: Path) -> None:
    assert customise_chroot.GUEST_GPU_FILE == GUEST_GPU_FILE
    customise_chroot.write_readiness_unit(tmp_path)
    script = tmp_path / customise_chroot.GPU_REPORT_SCRIPT
    assert script.read_text() == Path(gpu_report.__file__).read_text()
    assert script.stat().st_mode & 0o777 == 0o755 and script.read_text().startswith("#!/usr/bin/python3\n")
    unit = (tmp_path / "etc/systemd/system" / customise_chroot.READY_UNIT).read_text()
    exec_start = unit.split("ExecStart=", 1)[1].split("\n\n", 1)[0]
    # After cloud-init (which installs a cloud_init image's driver), before the ready file.
    order = [exec_start.index(w) for w in ("cloud-init status --wait", f"/{script.relative_to(tmp_path)}", "mv ")]
    assert order == sorted(order)
    assert f"--out {GUEST_GPU_FILE}" in exec_start


@pytest.mark.parametrize(
    ("boot_finished", "report", "rc", "out"),
    [
        (False, None, 10, ""),
        (True, None, 11, ""),
        (True, "", 11, ""),
        (True, '{"version": 1}\n', 0, '{"version": 1}\n'),
    ],
)
def test_the_login_command_tells_not_finished_from_not_reported(
    tmp_path: Path, boot_finished: bool, report: str | None, rc: int, out: str
) -> None:
    """The command the agent's login runs, by the guest's shell, on a tree standing in for the guest's root."""
    finished = tmp_path / guest_ssh.BOOT_FINISHED.lstrip("/")
    written = tmp_path / GUEST_GPU_FILE.lstrip("/")
    if boot_finished:
        finished.parent.mkdir(parents=True)
        finished.touch()
    if report is not None:
        written.parent.mkdir(parents=True)
        written.write_text(report)
    command = guest_ssh.READINESS_COMMAND.replace(guest_ssh.BOOT_FINISHED, str(finished)).replace(
        GUEST_GPU_FILE, str(written)
    )
    res = subprocess.run([shutil.which("sh") or "/bin/sh", "-c", command], capture_output=True, text=True)
    assert (res.returncode, res.stdout) == (rc, out)
    assert os.path.exists(finished) == boot_finished
