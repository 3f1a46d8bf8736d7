"""Every service binary answers `--help` and `--version` without starting anything, and refuses other arguments.

Postgres and NATS point at a loopback port nobody listens on and the start-up timeout is left at its 30 s: a binary
that ignored its arguments and began to start would still be waiting when the 10 s subprocess timeout ends it.
"""

from __future__ import annotations

import os
import subprocess
import tomllib
from pathlib import Path

import pytest

from gpuaas_common.service_args import package_version
from gpuaas_dev.stack.processes import bin_path
from gpuaas_dev.testing.servers import free_port

ROOT = Path(__file__).resolve().parents[2]
# Every console script but the developer CLI is a service process configured by GPUAAS_* variables.
SERVICE_SCRIPTS = sorted(set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]) - {"gpuaas"})


def _run(script: str, arg: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    dead = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUAAS_")}
    env |= {
        "GPUAAS_DATABASE_URL": f"postgresql://gpuaas:pw@127.0.0.1:{dead}/gpuaas",
        "GPUAAS_NATS_URL": f"nats://127.0.0.1:{dead}",
        "GPUAAS_NATS_INSECURE_DEV": "true",
        "GPUAAS_READY_FILE": str(tmp_path / "ready.json"),
        "GPUAAS_FLEET_FILE": str(tmp_path / "fleet.json"),
        "GPUAAS_NODE_ID": "node-cli-test",
    }
    return subprocess.run([bin_path(script), arg], env=env, capture_output=True, text=True, timeout=10)


def test_every_service_script_is_covered() -> None:
    assert {"gpuaas-allocator", "gpuaas-node-agent", "gpuaas-sim-fleet"} <= set(SERVICE_SCRIPTS)


@pytest.mark.parametrize("script", SERVICE_SCRIPTS)
def test_help_lists_the_settings_at_once_and_starts_nothing(script: str, tmp_path: Path) -> None:
    # "At once" is shown by what did not happen (no log line, no ready file, no connection to the dead ports
    # waited on), not by a wall-clock bound: that is a benchmark's, and a loaded machine broke it.
    done = _run(script, "--help", tmp_path)
    assert done.returncode == 0, done.stderr
    assert f"usage: {script}" in done.stdout
    assert "GPUAAS_NATS_URL" in done.stdout and "GPUAAS_DATABASE_URL" in done.stdout
    assert done.stderr == "", "no log line: nothing was started"
    assert not (tmp_path / "ready.json").exists()


def test_the_agent_help_still_lists_its_host_checks(tmp_path: Path) -> None:
    done = _run("gpuaas-node-agent", "--help", tmp_path)
    assert "discover" in done.stdout and "parity" in done.stdout


@pytest.mark.parametrize("script", SERVICE_SCRIPTS)
def test_version_names_the_installed_distribution(script: str, tmp_path: Path) -> None:
    done = _run(script, "--version", tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"{script} {package_version()}"
    assert package_version() != "unknown"


@pytest.mark.parametrize("script", SERVICE_SCRIPTS)
def test_an_unknown_argument_is_one_line_and_exit_2(script: str, tmp_path: Path) -> None:
    done = _run(script, "--nope", tmp_path)
    assert done.returncode == 2
    assert done.stdout == ""
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and "--nope" in lines[0], done.stderr
    assert not (tmp_path / "ready.json").exists()
