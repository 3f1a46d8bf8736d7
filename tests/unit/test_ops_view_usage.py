"""The usage rule of the ops read models (gpuaas_ops_view.domain.usage): which lifecycle moves make a record, its
start and stop to the second, and a month's share of it."""

from __future__ import annotations

import itertools
from datetime import datetime, timedelta, timezone

import pytest

from gpuaas_ops_view.domain.usage import Move, month_bounds, seconds_within, usage_of

T0 = datetime(2026, 10, 31, 22, 0, 0, 700_000, tzinfo=timezone.utc)


def _moves(*states: str, step: timedelta = timedelta(minutes=30)) -> list[Move]:
    return [
        Move(i + 1, s, T0 + i * step, f"e{i + 1}", "force_released" if s == "failed" else None)
        for i, s in enumerate(states)
    ]


@pytest.mark.parametrize(
    "states",
    [
        ("accepted", "unschedulable"),
        ("accepted", "placed", "provisioning", "failed"),
        ("accepted", "placed", "failed"),
        ("accepted", "placed", "provisioning", "releasing", "released"),
        ("accepted", "releasing", "released"),
        ("accepted", "placed", "provisioning", "releasing", "failed"),
    ],
    ids=[
        "unschedulable",
        "failed-provisioning",
        "failed-placed",
        "release-while-provisioning",
        "release-early",
        "release-failed-before-active",
    ],
)
def test_never_active_is_no_usage(states: tuple[str, ...]) -> None:
    assert usage_of(_moves(*states)) is None


def test_active_to_released_to_the_second_in_any_order() -> None:
    moves = _moves("accepted", "placed", "provisioning", "active", "releasing", "released")
    for order in itertools.permutations(moves):
        usage = usage_of(list(order))
        assert usage is not None
        assert usage.started_at == datetime(2026, 10, 31, 23, 30, tzinfo=timezone.utc)  # .7 cut off
        assert usage.stopped_at == datetime(2026, 11, 1, 0, 30, tzinfo=timezone.utc)
        assert (usage.seconds, usage.ended, usage.end_reason_code) == (3600, "released", None)
        assert (usage.start_event_id, usage.stop_event_id) == ("e4", "e6")


def test_failed_while_active_or_releasing_ends_it_with_the_reason() -> None:
    for states in (("provisioning", "active", "failed"), ("provisioning", "active", "releasing", "failed")):
        usage = usage_of(_moves(*states))
        assert usage is not None and usage.ended == "failed" and usage.end_reason_code == "force_released"
        assert usage.seconds == 1800 * (len(states) - 2)


def test_still_active_is_open_and_a_stop_before_the_start_is_zero() -> None:
    usage = usage_of(_moves("provisioning", "active"))
    assert usage is not None and not usage.closed and usage.seconds is None
    skewed = [Move(4, "active", T0, "a"), Move(5, "released", T0 - timedelta(seconds=2), "r")]
    usage = usage_of(skewed)
    assert usage is not None and usage.seconds == 0


def test_months_split_a_record_exactly() -> None:
    start = datetime(2026, 10, 31, 22, 0, 0, tzinfo=timezone.utc)
    stop = datetime(2027, 1, 1, 0, 0, 1, tzinfo=timezone.utc)
    months = [month_bounds(m) for m in ("2026-09", "2026-10", "2026-11", "2026-12", "2027-01")]
    shares = [seconds_within(start, stop, lo, hi) for lo, hi in months]
    assert shares == [0, 7200, 30 * 86400, 31 * 86400, 1]
    assert sum(shares) == int((stop - start).total_seconds())
    assert month_bounds("2026-12") == (
        datetime(2026, 12, 1, tzinfo=timezone.utc),
        datetime(2027, 1, 1, tzinfo=timezone.utc),
    )
    for bad in ("2026-13", "2026-1", "26-11", "2026-11-01", ""):
        with pytest.raises(ValueError):
            month_bounds(bad)
