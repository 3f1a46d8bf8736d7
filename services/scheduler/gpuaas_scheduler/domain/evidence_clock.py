"""Whose clock orders a host's reports. Pure.

Evidence is applied only when newer than the last report applied, judged by the time the host put in the
report. A host whose clock runs ahead — or that lies — would otherwise freeze its own evidence: one report
dated next year and every honest report after it is "older" and ignored (found by the bus fuzzer, which
sends timestamps far in the future). So a report is never taken as later than the moment it is received.
"""

from __future__ import annotations

from datetime import datetime, timezone


def as_received(reported: datetime, now: datetime | None = None) -> datetime:
    """`reported`, but not later than `now` (the receiver's clock)."""
    now = now or datetime.now(timezone.utc)
    if reported.tzinfo is None:
        reported = reported.replace(tzinfo=timezone.utc)
    return min(reported, now)
