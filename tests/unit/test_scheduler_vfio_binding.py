"""Which VFIO binding a host is asked for as its mode or approved slots change (runbook: persistent VFIO binding
only once the host is intentionally in slice mode, from the approved topology)."""

from __future__ import annotations

import pytest

from gpuaas_scheduler.domain.host_mode import BAREMETAL, CONVERTING, DRAINED, RETIRED, SLICE
from gpuaas_scheduler.domain.vfio_binding import SlotDevices, binding_change

S0 = SlotDevices("s0", "0000:18:00.0", "0000:29:00.1", "available")
S1 = SlotDevices("s1", "0000:2a:00.0", None, "active")
GONE = SlotDevices("s2", "0000:3b:00.0", "0000:29:00.3", "retired")
EMULATED = SlotDevices("lab-0", None, None, "available")


@pytest.mark.parametrize("from_mode", [CONVERTING, DRAINED, SLICE])
def test_entering_or_changing_slice_mode_binds_the_approved_passthrough_slots(from_mode: str) -> None:
    assert binding_change(from_mode, SLICE, [S0, S1, GONE, EMULATED]) == ("bind", [S0, S1])


@pytest.mark.parametrize(("from_mode", "to_mode"), [(DRAINED, BAREMETAL), (DRAINED, CONVERTING), (DRAINED, RETIRED)])
def test_leaving_the_modes_that_keep_slices_releases_every_slot_it_may_have_bound(from_mode: str, to_mode: str) -> None:
    assert binding_change(from_mode, to_mode, [S0, GONE, EMULATED]) == ("unbind", [S0, GONE])


@pytest.mark.parametrize(
    ("from_mode", "to_mode"), [(SLICE, DRAINED), (BAREMETAL, CONVERTING), (CONVERTING, RETIRED), (RETIRED, BAREMETAL)]
)
def test_changes_that_keep_or_never_had_a_binding_ask_nothing(from_mode: str, to_mode: str) -> None:
    assert binding_change(from_mode, to_mode, [S0, S1]) is None


def test_a_host_of_emulated_or_retired_slots_only_is_asked_nothing_to_bind() -> None:
    assert binding_change(CONVERTING, SLICE, [EMULATED, GONE]) is None
    assert binding_change(DRAINED, BAREMETAL, [EMULATED]) is None
