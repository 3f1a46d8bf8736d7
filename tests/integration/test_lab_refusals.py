"""The lab refuses, in one line and before it makes anything, where it cannot run: a user who is not root, and
root without the capabilities a network namespace needs (a container's root, say)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from gpuaas_dev.lab import preflight

# Dropping privileges needs them first; where the lab's packages are missing the refusal is another one,
# tested in tests/unit/test_lab_preflight.py.
pytestmark = pytest.mark.skipif(
    not preflight.installed() or os.geteuid() != 0,
    reason="dropping to an unprivileged user or capability set needs root and the lab's packages",
)

GPUAAS = str(Path(sys.executable).parent / "gpuaas")
DROPS = {
    "not root": ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"],
    "root without capabilities": ["setpriv", "--inh-caps=-all", "--bounding-set=-all"],
}
SAYS = {
    "not root": "the lab needs root",
    "root without capabilities": "cannot make a network namespace",
}


def _probe_namespaces() -> list[str]:
    netns = Path("/run/netns")
    return sorted(p.name for p in netns.iterdir() if p.name.startswith("gpuaas-")) if netns.is_dir() else []


@pytest.mark.parametrize("who", sorted(DROPS))
def test_the_lab_refuses_in_one_line_where_it_may_not_make_a_namespace(who: str, tmp_path: Path) -> None:
    run_dir = tmp_path / "lab"
    before = _probe_namespaces()
    done = subprocess.run(
        [*DROPS[who], GPUAAS, "lab", "run", "--run-dir", str(run_dir)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd="/",
    )
    assert done.returncode == 3, done.stderr
    assert done.stdout == ""
    (line,) = done.stderr.splitlines()  # one line, no traceback
    assert line.startswith("gpuaas lab: ") and SAYS[who] in line
    assert not run_dir.exists()  # nothing made: no run dir, no namespace, no loop device
    assert _probe_namespaces() == before
