"""Hugepages are an explicit opt-in of the runtime profile, never implied by its memory size."""

from __future__ import annotations

import pytest

from gpuaas_node_agent.domain.profiles import runtime_profile, vm_resources


def test_the_tuned_profile_opts_into_hugepages() -> None:
    assert vm_resources("h200_1g_24c_64g", 2) == (48, 131072, True)


@pytest.mark.parametrize("profile", ["h200_1g_24c_48g", "h200_1g_16c_32g", "h200_2g_48c_128g", "h200_1g_8c_16g"])
def test_other_shapes_do_not_get_hugepages_for_their_size(profile: str) -> None:
    # Before: every profile with >= 32 GiB per GPU was given hugepages.
    assert runtime_profile(profile).hugepages is False
    assert vm_resources(profile, 1)[2] is False


def test_unknown_profile_is_refused() -> None:
    with pytest.raises(ValueError):
        vm_resources("a100_1g", 1)


def test_the_default_profile_is_the_tested_shape_without_hugepages() -> None:
    from gpuaas_common.profiles import DEFAULT_PROFILE, hugepages_1g_needed, runtime_profile

    plain, tuned = runtime_profile(DEFAULT_PROFILE), runtime_profile("h200_1g_24c_64g")
    assert (plain.gpus, plain.cores, plain.memory_gib, plain.hugepages) == (1, 24, 64, False)
    assert (tuned.gpus, tuned.cores, tuned.memory_gib, tuned.hugepages) == (1, 24, 64, True)
    assert hugepages_1g_needed(DEFAULT_PROFILE, 8) == 0 and hugepages_1g_needed("h200_1g_24c_64g", 2) == 128
    assert not runtime_profile("h200_2g_48c_128g_plain").hugepages
