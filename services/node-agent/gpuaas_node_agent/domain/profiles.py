"""VM sizing per slot profile. Pure."""

from __future__ import annotations

import re

_PROFILE = re.compile(r"^h200_(\d+)g_(\d+)c_(\d+)g$")


def vm_resources(profile: str, slots: int) -> tuple[int, int, bool]:
    """(vcpus, memory MiB, hugepages) for `slots` slots of a per-GPU profile like h200_1g_24c_64g."""
    match = _PROFILE.match(profile)
    if not match:
        raise ValueError(f"unknown slot profile {profile!r}")
    gpus, cores, mem_gib = (int(g) for g in match.groups())
    per_slot = slots / gpus
    return int(cores * per_slot), int(mem_gib * 1024 * per_slot), mem_gib >= 32
