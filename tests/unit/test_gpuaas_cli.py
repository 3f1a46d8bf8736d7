"""The `gpuaas` command line answers bad input itself, at once, on the right stream and with the right exit code
(0 done, 1 answered with a failure, 2 bad argument, 3 nothing to talk to, 4 no answer in time)."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
from typer.testing import CliRunner

from gpuaas_common.contract import messages as m
from gpuaas_dev.cli import app
from gpuaas_dev.cli.allocations import table_lines
from gpuaas_dev.cli.events import event_line
from gpuaas_dev.testing.servers import free_port

GPUAAS = str(Path(sys.executable).parent / "gpuaas")


@pytest.fixture
def run(tmp_path, monkeypatch):
    """Invoke the CLI with no NATS configured: a command that got past its argument checks would try to
    reach the bus and fail with 3 ('no NATS URL'), so a 2 proves it refused before publishing."""
    for var in ("GPUAAS_NATS_URL", "GPUAAS_NATS_CREDS", "GPUAAS_NATS_CA_FILE"):
        monkeypatch.delenv(var, raising=False)

    def invoke(*argv: str):
        return CliRunner().invoke(app, [*argv, "--run-dir", str(tmp_path)] if argv[0] != "node-agent" else list(argv))

    return invoke


@pytest.mark.parametrize(
    "argv, allowed",
    [
        (
            ["--shape", "gpu_slice", "--gpus", "0"],
            "invalid --gpus: gpu_slice (h200-sxm-slice) takes 1, 2, 4 or 8 GPUs, not 0",
        ),
        (["--shape", "gpu_slice", "--gpus", "-2"], "takes 1, 2, 4 or 8 GPUs, not -2"),
        (["--shape", "gpu_slice", "--gpus", "3"], "takes 1, 2, 4 or 8 GPUs, not 3"),
        (["--shape", "gpu_slice", "--gpus", "16"], "takes 1, 2, 4 or 8 GPUs, not 16"),
        (["--shape", "baremetal", "--gpus", "4"], "invalid --gpus: baremetal (h200-sxm) takes 8 GPUs, not 4"),
        (["--shape", "vm"], "invalid --shape: 'vm'; must be gpu_slice or baremetal"),
    ],
)
def test_a_bad_allocation_request_is_refused_before_anything_is_published(run, argv, allowed) -> None:
    res = run("allocate", *argv)
    assert res.exit_code == 2, res.output
    assert res.stderr.strip().splitlines() == [res.stderr.strip()], "one line"
    assert allowed in res.stderr, res.stderr
    assert "NATS" not in res.stderr, "it must not have got as far as looking for the bus"
    assert res.stdout == ""


def test_a_good_request_gets_past_the_checks_and_only_then_needs_the_bus(run) -> None:
    res = run("allocate", "--shape", "gpu_slice", "--gpus", "4")
    assert res.exit_code == 3 and "no NATS URL" in res.stderr, res.output


def test_bad_ids_and_hostnames_are_one_line_usage_errors(run) -> None:
    release = run("release", "not-a-uuid")
    assert release.exit_code == 2 and "invalid allocation id 'not-a-uuid'" in release.stderr
    host = run("allocate", "--shape", "gpu_slice", "--hostname", "Bad_Name")
    assert host.exit_code == 2 and "hostname" in host.stderr and "Traceback" not in host.output
    assert len(host.stderr.strip().splitlines()) == 1, host.stderr
    show = run("allocations", "show", "42")
    assert show.exit_code == 2 and "not a UUID" in show.stderr
    state = run("allocations", "list", "--state", "running")
    assert state.exit_code == 2 and "active" in state.stderr


@pytest.mark.parametrize("command", ["parity", "discover"])
def test_node_agent_checks_against_a_missing_root_say_so(run, command, tmp_path) -> None:
    res = run("node-agent", command, "--root", str(tmp_path / "nonexistent"))
    assert res.exit_code == 2
    assert res.stderr.strip() == f"no such root: {tmp_path / 'nonexistent'} (give / on a host, or a fixture tree)"
    assert res.stdout == "", "no FAIL lines and no empty report for a root that is not there"


def test_dev_status_without_a_stack(run, tmp_path) -> None:
    # 3, not 1: the exit-code table's "nothing to talk to", as every other command says of a missing stack.
    as_json = run("dev", "status", "--json")
    assert as_json.exit_code == 3
    assert json.loads(as_json.stdout) == {
        "running": False,
        "status": "absent",
        "run_dir": str(tmp_path),
        "services": {},
    }
    human = run("dev", "status")
    assert human.exit_code == 3 and human.stdout == "" and "no stack in" in human.stderr


@pytest.mark.parametrize("url", ["nats://127.0.0.1:{port}", "bogus:::x"])
def test_an_unreachable_or_malformed_nats_url_is_one_line_and_exit_3(url, tmp_path) -> None:
    # A real process: nats-py's tracebacks went through logging straight to the process's stderr.
    argv = [GPUAAS, "--insecure-dev", "allocate", "--shape", "gpu_slice", "--run-dir", str(tmp_path)]
    argv += ["--nats-url", url.format(port=free_port())]
    res = subprocess.run(argv, capture_output=True, text=True, timeout=60, env={"PATH": "/usr/bin:/bin"})
    assert res.returncode == 3, res.stderr
    assert "Traceback" not in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert ("cannot connect to NATS" in res.stderr) or ("bad NATS URL" in res.stderr)


def test_an_event_is_one_line_even_with_newlines_in_its_reason() -> None:
    alloc = str(uuid.uuid4())
    data = {
        "type": "allocation.failed",
        "occurred_at": "2030-01-01T12:34:56.789+00:00",
        "payload": {"allocation_id": alloc, "reason_code": "boot_failed", "reason": "line one\nline two"},
    }
    line = event_line("gpuaas.allocation.event.failed", data)
    assert "\n" not in line and alloc in line and "12:34:56.789" in line and "boot_failed" in line
    other = event_line("gpuaas.node.n1.report.parity", {"type": "node.parity_reported", "payload": {"a": [1]}})
    assert "\n" not in other and "node.parity_reported" in other


def test_the_allocation_table_has_an_age_and_stays_narrow_whatever_the_values() -> None:
    now = datetime.now(timezone.utc)
    long = [
        m.AllocationSummary(
            allocation_id=uuid.uuid4(),
            tenant_id="a-very-long-tenant-name-indeed",
            shape=shape,
            sku="h200-sxm",
            gpu_count=8,
            region="default",
            image="ubuntu",
            state="unschedulable",
            node_id="slice-host-with-a-long-name-0001",
            created_at=now - timedelta(seconds=119),
            updated_at=now,
        )
        for shape in ("gpu_slice", "baremetal")
    ]
    lines = table_lines(long)
    assert lines[0].split() == ["ALLOCATION", "TENANT", "SHAPE", "STATE", "NODE", "AGE"]
    assert all(len(line) <= 84 for line in lines), [len(line) for line in lines]
    assert str(long[0].allocation_id) in lines[1], "the full id, so it can be pasted into show or release"
    assert "8 slice" in lines[1] and "8 bm" in lines[2] and "unschedulable" in lines[1]
    assert "a-very-…" in lines[1] and "slice-host…" in lines[1] and lines[1].split()[-1] in ("119s", "2m")
    # The usual rows fit 80 columns in every state: an 8-letter tenant and node, an age of up to 4 letters.
    usual = [
        long[0].model_copy(
            update={
                "tenant_id": "tenant-a",
                "node_id": "slice-01",
                "state": state,
                "created_at": now - timedelta(minutes=100),
            }
        )
        for state in ("accepted", "placed", "provisioning", "active", "releasing", "released", "failed")
    ]
    lines = table_lines(usual)
    assert all(len(line) <= 80 for line in lines), [len(line) for line in lines]
    assert [line.split()[-1] for line in lines[1:]] == ["100m"] * len(usual)
    assert lines[1].index("100m") == lines[0].index("AGE"), "aligned columns"


def test_show_names_each_provisioning_phase_and_prints_flags_as_yes_or_no() -> None:
    from gpuaas_dev.cli.allocations import show_text
    from gpuaas_dev.cli.bus import describe_event

    at = "2030-01-01T12:00:00Z"
    doc = {
        "allocation_id": str(uuid.uuid4()), "tenant_id": "t1", "shape": "gpu_slice", "gpu_count": 2,
        "sku": "h200-sxm-slice", "region": "default", "image": "img", "state": "active", "node_id": "slice-01",
        "access": {"ip": "10.0.0.5", "ssh_ready": True, "user": None}, "failure_code": None,
        "created_at": at, "updated_at": at,
        "timeline": [
            {"seq": 1, "state": "provisioning", "previous_state": "placed", "reason_code": None, "at": at},
            {"seq": 2, "state": "provisioning", "previous_state": "provisioning", "reason_code": "provision_phase",
             "at": at, "detail": {"phase": "clone_image", "seconds": 0.0834}},
            {"seq": 3, "state": "failed", "previous_state": "provisioning", "reason_code": "boot_failed", "at": at,
             "detail": {}},
        ],
    }  # fmt: skip
    lines = show_text(doc, "table").splitlines()
    assert "access     ip 10.0.0.5, ssh_ready yes" in lines
    assert lines[-2].endswith("provisioning -> provisioning (provision_phase: clone_image 0.08s)")
    assert lines[-1].endswith("provisioning -> failed (boot_failed)")
    released = describe_event("released", {"cleanup": {"verified": True, "wipe_proofs": [{}, {}]}})
    assert released == "[green]released[/]: cleanup verified, 2 wipe proof(s)"
    assert "cleanup not verified" in describe_event("released", {"cleanup": {"verified": False}})
    no_room = {"reason_code": "no_capacity", "reason": "r", "free_gpus": 1, "requested_gpus": 2}
    assert describe_event("unschedulable", no_room).endswith("(free GPUs 1, asked 2)")
    over = {"reason_code": "quota_exceeded", "reason": "tenant t holds 2 of its 4 GPU quota; 4 more requested"}
    assert (
        describe_event("unschedulable", {**over, "free_gpus": 0})
        == f"[red]unschedulable[/]: quota_exceeded: {over['reason']}"
    )
