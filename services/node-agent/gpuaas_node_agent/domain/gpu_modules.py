"""Which GPU is which module of the HGX board, and what Fabric Manager the host runs. Pure.

NVLink partitions are sets of module IDs (1-8), and Fabric Manager reports empty PCI addresses for them on
H100 and later, so the host must map each GPU's PCI address to its module ID itself. `nvidia-smi -q` prints one
block per GPU, headed by its address (`GPU 00000000:0F:00.0`), with a `Module Id` line under Platform Info
(older drivers spell it `Module ID` or `GPU Module ID`); a guest without a board says N/A.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Mapping

MODULE_IDS = range(1, 9)
_GPU_HEADER = re.compile(r"^GPU ([0-9A-Fa-f]{4,8}):([0-9A-Fa-f]{2}):([0-9A-Fa-f]{2})\.([0-7])\s*$")
_MODULE_LINE = re.compile(r"^\s+(?:GPU )?Module I[Dd]\s*:\s*(\S+)\s*$")
_VERSION = re.compile(r"(\d+\.\d+(?:\.\d+)*)")
FABRIC_MODES = {"0": "baremetal", "1": "shared_nvswitch", "2": "vgpu"}


def _bdf(domain: str, bus: str, dev: str, fn: str) -> str:
    # nvidia-smi prints an 8-digit domain in upper case; sysfs a 4-digit one in lower case.
    return f"{domain[-4:]}:{bus}:{dev}.{fn}".lower()


def parse_module_ids(text: str) -> tuple[dict[str, int], list[str]]:
    """(PCI address -> module ID, problems) from `nvidia-smi -q` output. A GPU whose module ID is N/A or out
    of 1-8 is left out and named among the problems."""
    out: dict[str, int] = {}
    problems: list[str] = []
    current: str | None = None
    for line in text.splitlines():
        header = _GPU_HEADER.match(line)
        if header:
            current = _bdf(*header.groups())
            continue
        found = _MODULE_LINE.match(line)
        if found and current is not None and current not in out:
            value = found.group(1)
            if value.isdigit() and int(value) in MODULE_IDS:
                out[current] = int(value)
            else:
                problems.append(f"GPU {current} reports module ID {value}, not one of 1-8")
            current = None
    return out, problems


def mapping_problems(gpus: list[str], modules: Mapping[str, int]) -> list[str]:
    """Why a host's GPU -> module map cannot place NVLink partitions: a GPU without a module ID (when any has
    one) or a module ID claimed twice. An empty map is no problem here: the host reports none and its slots
    are placed without partitions."""
    if not modules:
        return []
    problems = [f"GPU {g} has no module ID while other GPUs of the host do" for g in sorted(gpus) if g not in modules]
    counts = Counter(modules.values())
    for module, n in sorted(counts.items()):
        if n > 1:
            holders = sorted(g for g, m in modules.items() if m == module)
            problems.append(f"module ID {module} is claimed by {n} GPUs: {', '.join(holders)}")
    return problems


def fabric_mode(cfg_text: str | None) -> str:
    """FABRIC_MODE of fabricmanager.cfg as a name; the file's default is 0 (bare metal), an unreadable file
    or an unknown value is `unknown`."""
    if cfg_text is None:
        return "unknown"
    mode = "0"
    for line in cfg_text.splitlines():
        stripped = line.strip()
        if stripped.startswith("FABRIC_MODE="):
            mode = stripped.split("=", 1)[1].strip() or "0"
    return FABRIC_MODES.get(mode, "unknown")


def fabric_version(version_output: str) -> str | None:
    """The version `nv-fabricmanager --version` prints ("Fabric Manager version is : 550.127.05")."""
    found = _VERSION.search(version_output)
    return found.group(1) if found else None
