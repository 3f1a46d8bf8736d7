"""VM sizing per slot profile. Pure.

The profile table itself (shapes, and which runtime profiles opt into 1 GiB hugepages) lives in
gpuaas_common.profiles: the scheduler places hugepage profiles only on hosts that reported the pages, so
both read the same table.
"""

from __future__ import annotations

from gpuaas_common.profiles import TUNED_PROFILES, RuntimeProfile, hugepages_1g_needed, runtime_profile

__all__ = ["TUNED_PROFILES", "RuntimeProfile", "hugepages_1g_needed", "runtime_profile", "vm_resources"]


def vm_resources(profile: str, slots: int) -> tuple[int, int, bool]:
    """(vcpus, memory MiB, hugepages) for `slots` slots of a per-GPU profile like h200_1g_24c_64g."""
    p = runtime_profile(profile)
    per_slot = slots / p.gpus
    return int(p.cores * per_slot), int(p.memory_gib * 1024 * per_slot), p.hugepages
