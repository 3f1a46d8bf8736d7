"""The slot lifecycle rules, stated as rules (domain/slots.py)."""

from __future__ import annotations

import itertools
from typing import get_args

import pytest

from gpuaas_common.contract import messages as m
from gpuaas_scheduler.domain.slots import (
    APPROVAL_REPLACES,
    IN_USE,
    SLOT_STATUSES,
    SLOT_TRANSITIONS,
    TOUCHED,
    InvalidSlotTransition,
    check_approval,
    check_slot_transition,
    movable_from,
)

HAPPY_PATH = ["available", "reserved", "provisioning", "active", "releasing", "cleanup", "available"]


def test_the_table_covers_every_status_the_database_allows():
    assert set(SLOT_TRANSITIONS) == set(SLOT_STATUSES)
    assert all(set(tos) <= set(SLOT_STATUSES) for tos in SLOT_TRANSITIONS.values())


def test_the_contract_announces_exactly_the_statuses_a_slot_can_have():
    # scheduler.slots_changed carries a slot's status: a status the contract lacks would make every announcement
    # of a host holding one fail validation; one the scheduler lacks is a value no reader ever sees.
    assert get_args(m.SlotStatus) == SLOT_STATUSES


def test_a_slot_lives_from_available_back_to_available():
    for current, new in itertools.pairwise(HAPPY_PATH):
        check_slot_transition(current, new)  # raises on a refused step


@pytest.mark.parametrize("written", ["active", "releasing"])
def test_a_disk_a_vm_has_run_on_returns_only_through_cleanup(written):
    with pytest.raises(InvalidSlotTransition):
        check_slot_transition(written, "available") if written == "active" else check_slot_transition(
            written, "reserved"
        )
    assert "cleanup" in SLOT_TRANSITIONS[written] or "cleanup_blocked" in SLOT_TRANSITIONS[written]


def test_cleanup_blocked_leaves_only_for_available_after_a_repair():
    assert SLOT_TRANSITIONS["cleanup_blocked"] == {"available"}
    for status in SLOT_STATUSES:
        if status != "available":
            with pytest.raises(InvalidSlotTransition):
                check_slot_transition("cleanup_blocked", status)


def test_retired_is_final_for_the_mover_and_only_idle_slots_retire():
    assert SLOT_TRANSITIONS["retired"] == set()
    assert {s for s, tos in SLOT_TRANSITIONS.items() if "retired" in tos} == {"available", "disabled"}


def test_nothing_is_claimed_unless_available():
    assert {s for s, tos in SLOT_TRANSITIONS.items() if "reserved" in tos} == {"available"}


@pytest.mark.parametrize(
    "to, only_from, ok",
    [
        ("provisioning", ("reserved",), True),
        ("available", None, True),
        ("available", ("active",), False),  # a VM ran: never straight back
        ("reserved", ("cleanup_blocked",), False),
        ("active", ("reserved",), False),  # provisioning comes first
    ],
)
def test_a_mover_naming_a_forbidden_move_is_refused(to, only_from, ok):
    if ok:
        assert set(movable_from(to, only_from)) <= {s for s, tos in SLOT_TRANSITIONS.items() if to in tos}
    else:
        with pytest.raises(InvalidSlotTransition):
            movable_from(to, only_from)


# Approval is not a transition (see domain/slots.py): it rewrites an idle slot's binding, whatever its status.
# awaiting_wipe: re-approval keeps it awaiting its host's proof (domain/slot_wipe.py wipe_still_owed).
IDLE = {"available", "disabled", "retired", "awaiting_wipe"}


@pytest.mark.parametrize("current", [None, *SLOT_STATUSES])
@pytest.mark.parametrize("new", ["available", "disabled", "awaiting_wipe"])
def test_approval_creates_a_slot_or_rewrites_only_an_idle_one(current, new):
    if current is None or current in IDLE:
        check_approval(current, new)
    else:  # under a claim, or a disk that may still hold a tenant's data
        with pytest.raises(InvalidSlotTransition):
            check_approval(current, new)


@pytest.mark.parametrize("new", sorted(set(SLOT_STATUSES) - {"available", "disabled", "awaiting_wipe"}))
def test_approval_makes_a_slot_available_or_disabled_only(new):
    with pytest.raises(InvalidSlotTransition):
        check_approval(None, new)


def test_only_approval_brings_a_retired_slot_back():
    assert SLOT_TRANSITIONS["retired"] == set()
    check_approval("retired", "available")
    assert APPROVAL_REPLACES == IDLE and not APPROVAL_REPLACES & (IN_USE | TOUCHED | {"cleanup_blocked"})
