"""VM sizing per slot profile, and whether the runtime profile opts into 1 GiB hugepages. Pure.

A profile name like h200_1g_24c_64g gives the per-GPU shape. Hugepages are never implied by the size: a
runtime profile opts in explicitly (`RuntimeProfile.hugepages`), as the runbook's tuned h200_1g_24c_64g
profile does (the prototype staged 512 × 1 GiB pages for it); any other shape runs without them until
benchmark evidence makes it a tuned profile too.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_PROFILE = re.compile(r"^h200_(\d+)g_(\d+)c_(\d+)g$")


@dataclass(frozen=True)
class RuntimeProfile:
    name: str
    gpus: int
    cores: int
    memory_gib: int
    hugepages: bool = False


# Runtime profiles with explicit settings beyond their shape. Only these opt into hugepages.
TUNED_PROFILES = {"h200_1g_24c_64g": RuntimeProfile("h200_1g_24c_64g", 1, 24, 64, hugepages=True)}


def runtime_profile(profile: str) -> RuntimeProfile:
    tuned = TUNED_PROFILES.get(profile)
    if tuned is not None:
        return tuned
    match = _PROFILE.match(profile)
    if not match:
        raise ValueError(f"unknown slot profile {profile!r}")
    gpus, cores, mem_gib = (int(g) for g in match.groups())
    return RuntimeProfile(profile, gpus, cores, mem_gib)


def vm_resources(profile: str, slots: int) -> tuple[int, int, bool]:
    """(vcpus, memory MiB, hugepages) for `slots` slots of a per-GPU profile like h200_1g_24c_64g."""
    p = runtime_profile(profile)
    per_slot = slots / p.gpus
    return int(p.cores * per_slot), int(p.memory_gib * 1024 * per_slot), p.hugepages
