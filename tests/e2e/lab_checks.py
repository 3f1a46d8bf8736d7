"""What the lab tests look at on the machine: commands, the lab's libvirt, and a slot disk's bytes."""

from __future__ import annotations

import os
import subprocess
from typing import Any

import pytest

from gpuaas_dev.lab import preflight
from gpuaas_dev.lab.lab import LabState

# Not a skip left to rot: a machine without the lab's packages (a developer who never ran scripts/setup.sh) or
# without root cannot make a namespace or a loop device at all. setup.sh installs the packages and CI runs as
# root, so there the lab tests always run; and where both hold, a lab that does not work fails them, never skips.
lab_only = pytest.mark.skipif(
    not preflight.installed() or os.geteuid() != 0,
    reason="the lab needs its Debian packages (scripts/setup.sh) and root for network namespaces",
)


def run(argv: list[str], **kw: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, **kw)


def virsh(st: LabState, *args: str) -> subprocess.CompletedProcess[str]:
    return run(["virsh", "-c", st.libvirt_uri, *args])


def domains(st: LabState) -> list[str]:
    return [n for n in virsh(st, "list", "--all", "--name").stdout.split() if n]


def zeros_sampled(device: str, size: int, samples: int = 16) -> bool:
    """The device reads back as zeros at `samples` places spread over its size (a wipe that only discarded
    metadata, or skipped a range, shows here)."""
    with open(device, "rb") as f:
        for i in range(samples):
            f.seek((size // samples) * i)
            if f.read(65536).strip(b"\0"):
                return False
    return True
