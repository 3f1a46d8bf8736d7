"""Usage records: what an allocation is billed for, read off its lifecycle. Pure: no database, no bus.

The rule, from the allocator's state machine (its `domain/model.py` TRANSITIONS; the contract's lifecycle events):

    requested -> accepted -> placed -> provisioning -> active -> releasing -> released
    accepted -> unschedulable; placed | provisioning | active | releasing -> failed; a release from any state
    before a terminal one (accepted | placed | provisioning | active -> releasing)

- **start**: the allocation's `allocation.active`, the one moment the tenant got what was asked (a slice VM
  that answered SSH with its lease, a deployed and enrolled baremetal host). `active` is entered only from
  `provisioning`, and at most once.
- **stop**: the `allocation.released` or `allocation.failed` after it: the release finished (VM torn down and
  wiped, machine released through MAAS), or the allocation failed while active or releasing (a forced release
  by ops, a release task past its deadline, a teardown that failed). From `active` only these two end it, and
  every allocation that was active ends in one of them, so each usage record closes exactly once.
- **no usage**: an allocation that never became active: rejected, unschedulable, failed before active (a
  provision that failed or passed its deadline, a forced release while placed or provisioning), or released
  while still provisioning (the VM a late provision built is torn down without ever being handed over).
- **to the second**: start and stop are the events' own `occurred_at` (the allocator's clock), cut to the whole
  second in UTC; the record is `stop - start` seconds. A month (UTC) holds the seconds of the record inside it,
  so a record crossing a month boundary is split exactly and its months add up to the record. A record still
  running counts up to the moment asked.

The record is a function of the allocation's timeline, not of the order events arrived in: a replayed or
redelivered event changes nothing, and a rebuild from the streams writes the same record.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import get_args

from gpuaas_common.contract.messages import AllocationEnd as Ended

ENDS: tuple[Ended, ...] = get_args(Ended)
MONTH = re.compile(r"^(\d{4})-(0[1-9]|1[0-2])$")


@dataclass(frozen=True)
class Move:
    """One lifecycle transition on an allocation's timeline."""

    seq: int
    state: str
    at: datetime
    event_id: str
    reason_code: str | None = None


@dataclass(frozen=True)
class Usage:
    started_at: datetime
    start_event_id: str
    stopped_at: datetime | None = None
    stop_event_id: str | None = None
    ended: Ended | None = None
    end_reason_code: str | None = None

    @property
    def closed(self) -> bool:
        return self.stopped_at is not None

    @property
    def seconds(self) -> int | None:
        if self.stopped_at is None:
            return None
        return whole_seconds(self.stopped_at - self.started_at)


def to_the_second(at: datetime) -> datetime:
    """`at` in UTC, cut to the whole second (a time without a zone is taken as UTC)."""
    if at.tzinfo is None:
        at = at.replace(tzinfo=timezone.utc)
    return at.astimezone(timezone.utc).replace(microsecond=0)


def whole_seconds(delta: timedelta) -> int:
    return delta.days * 86400 + delta.seconds


def usage_of(moves: list[Move]) -> Usage | None:
    """The usage record the timeline `moves` make (in any order), or None when the allocation never became
    active. Stopped is never before started: the events of one allocation come from one allocator, but its
    replicas' clocks may differ by a little, and a negative record would bill nothing less than zero."""
    ordered = sorted(moves, key=lambda m: m.seq)
    start = next((m for m in ordered if m.state == "active"), None)
    if start is None:
        return None
    started = to_the_second(start.at)
    end = next((m for m in ordered if m.seq > start.seq and m.state in ENDS), None)
    if end is None:
        return Usage(started, start.event_id)
    stopped = max(to_the_second(end.at), started)
    if end.state == "released":
        return Usage(started, start.event_id, stopped, end.event_id, "released")
    return Usage(started, start.event_id, stopped, end.event_id, "failed", end.reason_code)


def month_bounds(month: str) -> tuple[datetime, datetime]:
    """`YYYY-MM` as the half-open UTC interval [first second of the month, first second of the next)."""
    match = MONTH.match(month)
    if match is None:
        raise ValueError("must be a month as YYYY-MM, e.g. 2026-11")
    year, mon = int(match.group(1)), int(match.group(2))
    start = datetime(year, mon, 1, tzinfo=timezone.utc)
    end = datetime(year + mon // 12, mon % 12 + 1, 1, tzinfo=timezone.utc)
    return start, end


def seconds_within(started: datetime, stopped: datetime, since: datetime, until: datetime) -> int:
    """The whole seconds of [started, stopped) inside [since, until); 0 when they do not meet."""
    return max(0, whole_seconds(min(stopped, until) - max(started, since)))
