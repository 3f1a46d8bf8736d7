"""The slot rules of the ops read models (gpuaas_ops_view.domain.models): a slot's status from its claims and the
scheduler's announcements of its host's slots, and where an announcement goes against the newest one read."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from typing import Any

import pytest

from gpuaas_ops_view.domain.models import place_announcement, slot_view_status

T0 = datetime(2026, 11, 27, 9, 0, tzinfo=timezone.utc)


def _claim(placed_min: int, released_min: int | None = None, outcome: str | None = None) -> dict[str, Any]:
    released = None if released_min is None else T0 + timedelta(minutes=released_min)
    return {"placed_at": T0 + timedelta(minutes=placed_min), "released_at": released, "outcome": outcome}


def _at(minute: int) -> datetime:
    return T0 + timedelta(minutes=minute)


def test_a_slot_never_placed_is_what_the_scheduler_announced():
    assert slot_view_status([], "disabled", _at(0)) == "disabled"
    assert slot_view_status([], "available", _at(0)) == "available"
    assert slot_view_status([], "cleanup_blocked", _at(0)) == "cleanup_blocked"
    # Nothing announced and no claim: what the placements said (a row they made).
    assert slot_view_status([], None, None) == "available"


def test_a_live_claim_holds_the_slot_whatever_was_announced():
    assert slot_view_status([_claim(5)], "available", _at(10)) == "held"
    assert slot_view_status([_claim(5)], "disabled", _at(1)) == "held"


@pytest.mark.parametrize(
    ("announced", "at", "claims", "expected"),
    [
        # Blocked by a refused wipe after the release the allocator reported verified: the scheduler judged.
        ("cleanup_blocked", 21, [_claim(5, 20, "wiped")], "cleanup_blocked"),
        # Repaired after a release that left it blocked.
        ("available", 30, [_claim(5, 20, "cleanup_blocked")], "available"),
        # Disabled before a later placement that ended wiped: the claim's end is newer.
        ("disabled", 1, [_claim(5, 20, "wiped")], "available"),
        # Announced healthy before a release that blocked it.
        ("available", 1, [_claim(5, 20, "cleanup_blocked")], "cleanup_blocked"),
        # A status the scheduler gave it while a claim held it defers to the claims, even when it is newer.
        ("active", 25, [_claim(5, 20, "wiped")], "available"),
        ("releasing", 25, [_claim(5, 20, "cleanup_blocked")], "cleanup_blocked"),
        # At the same moment, the announcement speaks.
        ("retired", 20, [_claim(5, 20, "wiped")], "retired"),
    ],
)
def test_otherwise_the_newer_of_the_announcement_and_the_last_end_speaks(announced, at, claims, expected):
    assert slot_view_status(claims, announced, _at(at)) == expected


def test_an_announcement_goes_by_its_number_against_the_newest_read():
    assert place_announcement(None, 1, "e1") == "newer"
    assert place_announcement((3, "e3"), 4, "e4") == "newer"
    assert place_announcement((3, "e3"), 2, "e2") == "older"
    assert place_announcement((3, "e3"), 3, "e3") == "repeat"
    assert place_announcement((3, "e3"), 3, "other") == "conflict"
