"""scripts/setup.sh refuses an interpreter older than pyproject.toml's requires-python in one line, before it
installs anything, and refuses an argument it does not know."""

from __future__ import annotations

import os
import subprocess
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SETUP = ROOT / "scripts" / "setup.sh"


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(SETUP), *args], capture_output=True, text=True, timeout=60,
                          env={**os.environ, **(env or {})})  # fmt: skip


def test_an_old_python_is_refused_first_in_one_line(tmp_path: Path) -> None:
    need = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"].lstrip(">= ")
    major, minor = (int(x) for x in need.split(".")[:2])
    old = tmp_path / "python-old"
    # An interpreter that reports a version one minor release too old (the shape `sys.version_info` prints).
    old.write_text(f"#!/bin/sh\necho {major}.{minor - 1}\n")
    old.chmod(0o755)
    res = run(env={"PYTHON": str(old)})
    assert res.returncode == 1
    assert res.stdout == "", "nothing was installed or even announced"
    assert res.stderr.splitlines() == [
        f"setup: {old} is Python {major}.{minor - 1}; gpuaas needs >= {need} (pyproject.toml requires-python): "
        "set PYTHON= to a newer one"
    ]
    missing = run(env={"PYTHON": str(tmp_path / "no-such-python")})
    assert missing.returncode == 1 and len(missing.stderr.splitlines()) == 1
    assert "does not run" in missing.stderr and f">= {need}" in missing.stderr


def test_an_unknown_argument_is_a_usage_error() -> None:
    res = run("--verbose")
    assert res.returncode == 2 and res.stdout == ""
    assert res.stderr.strip() == "setup: unknown argument '--verbose' (usage: scripts/setup.sh [-q])"
