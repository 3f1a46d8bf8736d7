"""A baremetal release's erase: the site's wipe policy mapped to MAAS's erase (allocator), and the release judged
with MAAS's read-back of that erase (gateway). Tables of every case."""

from __future__ import annotations

import pytest

from gpuaas_allocator.domain.erase import erase_mode_for
from gpuaas_maas_gateway.domain.operations import release_verdict


@pytest.mark.parametrize(
    "policy, mode",
    [
        ("nvme_format", "secure"),
        ("crypto_erase", "secure"),
        ("blkdiscard", "secure"),
        # An older scheduler's placement names none: the scheduler's default, blkdiscard.
        (None, "secure"),
        # A policy this allocator does not know: the overwrite alone.
        ("something_newer", "full"),
    ],
)
def test_a_site_wipe_policy_maps_to_a_maas_erase_that_is_never_quick(policy: str | None, mode: str) -> None:
    assert erase_mode_for(policy) == mode


@pytest.mark.parametrize(
    "status, erase_set, released, outcome, reason_code",
    [
        ("Ready", "Passed", True, "erased", None),
        ("Failed disk erasing", "Failed", False, "failed", "disk_erase_failed"),
        # MAAS's status is enough to say the erase failed, even before its result set is settled.
        ("Failed disk erasing", "Running", False, "failed", "disk_erase_failed"),
        ("Failed disk erasing", None, False, "failed", "disk_erase_failed"),
        ("Ready", "Timed out", False, "failed", "disk_erase_failed"),
        # Ready with no erase run after the submit: nothing shows the disks were erased.
        ("Ready", None, False, "unconfirmed", "disk_erase_unconfirmed"),
        ("Releasing failed", "Passed", False, "erased", "maas_failed"),
        ("Deployed", None, False, "unconfirmed", "maas_failed"),
    ],
)
def test_a_release_is_released_only_with_its_erase_read_back_as_passed(
    status: str, erase_set: str | None, released: bool, outcome: str, reason_code: str | None
) -> None:
    verdict = release_verdict(status, erase_set)
    assert verdict is not None
    assert (verdict.released, verdict.erase_outcome, verdict.reason_code) == (released, outcome, reason_code)


@pytest.mark.parametrize("erase_set", ["Running", "Pending"])
def test_a_release_whose_erase_still_runs_is_not_judged_yet(erase_set: str) -> None:
    assert release_verdict("Ready", erase_set) is None
