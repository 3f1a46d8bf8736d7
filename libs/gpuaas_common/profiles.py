"""Slice runtime profiles: the per-GPU shape a profile name gives, and which profiles opt into 1 GiB hugepages.

Shared because two services act on it: the node agent sizes the VM and backs its memory with hugepages,
and the scheduler places a slice of such a profile only on a host that reported enough of them. One table
keeps the two from disagreeing about which profile needs what.

Hugepages are never implied by a size: a runtime profile opts in explicitly, as the runbook's tuned
h200_1g_24c_64g profile does (the prototype staged 512 × 1 GiB pages for it, 64 per GPU); any other
shape runs without them until benchmark evidence makes it a tuned profile too. The default is the plain
profile of the tested shape (1 GPU = 24 vCPU / 64 GiB, no hugepages): the runbook has 1 GiB pages as
something infra "can explicitly request", so the tuned profile is opted into per host pool (the profile its
slots are approved with), never assumed. `<shape>_plain` names a shape without tuning even where a tuned
profile of that shape exists. Pure.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_PROFILE = re.compile(r"^h200_(\d+)g_(\d+)c_(\d+)g(_plain)?$")
PLAIN_SUFFIX = "_plain"


@dataclass(frozen=True)
class RuntimeProfile:
    name: str
    gpus: int
    cores: int
    memory_gib: int
    hugepages: bool = False

    @property
    def hugepages_1g_per_gpu(self) -> int:
        """1 GiB pages one GPU's share of the VM needs (all of its memory is hugepage-backed), else 0."""
        return self.memory_gib // self.gpus if self.hugepages else 0


# Runtime profiles with explicit settings beyond their shape. Only these opt into hugepages.
TUNED_PROFILES = {"h200_1g_24c_64g": RuntimeProfile("h200_1g_24c_64g", 1, 24, 64, hugepages=True)}
DEFAULT_PROFILE = "h200_1g_24c_64g" + PLAIN_SUFFIX

if DEFAULT_PROFILE in TUNED_PROFILES:
    raise RuntimeError("the default profile must be plain: hugepages are opt-in")

# A VM of k GPUs then needs exactly k × hugepages_1g_per_gpu pages, the sum the scheduler reserves.
for _p in TUNED_PROFILES.values():
    if _p.hugepages and _p.memory_gib % _p.gpus:
        raise RuntimeError(f"tuned profile {_p.name}: memory must split into whole GiB per GPU")


def runtime_profile(profile: str) -> RuntimeProfile:
    """The profile by name; ValueError for a name that is neither tuned nor an h200_<g>g_<c>c_<m>g shape."""
    tuned = TUNED_PROFILES.get(profile)
    if tuned is not None:
        return tuned
    match = _PROFILE.match(profile)
    if not match:
        raise ValueError(f"unknown slot profile {profile!r}")
    gpus, cores, mem_gib = (int(g) for g in match.groups()[:3])
    if gpus < 1:
        raise ValueError(f"slot profile {profile!r} has no GPU")
    return RuntimeProfile(profile, gpus, cores, mem_gib)


def hugepages_1g_needed(profile: str, gpus: int) -> int:
    """1 GiB hugepages a VM of `gpus` slots of this profile needs; 0 when the profile does not opt in."""
    return runtime_profile(profile).hugepages_1g_per_gpu * gpus


def hugepage_profiles() -> dict[str, int]:
    """Profile name -> 1 GiB pages per GPU, for every profile that opts into hugepages (others need none)."""
    return {p.name: p.hugepages_1g_per_gpu for p in TUNED_PROFILES.values() if p.hugepages}
