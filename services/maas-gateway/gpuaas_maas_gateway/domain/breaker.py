"""A circuit breaker per MAAS site. Pure: time is passed in.

Consecutive connection failures (nothing reached MAAS) open it for a cool-down. While open, no call
is made and operations simply wait in their current state; they are not failed. After the cool-down
one trial call is let through (half-open): if MAAS answers the breaker closes, if not it opens again.
Any HTTP answer counts as MAAS being reachable, whatever its status.
"""

from __future__ import annotations

import enum


class BreakerState(enum.IntEnum):
    CLOSED = 0
    HALF_OPEN = 1
    OPEN = 2


class CircuitBreaker:
    def __init__(self, failures_to_open: int, cooldown_s: float) -> None:
        self.failures_to_open = failures_to_open
        self.cooldown_s = cooldown_s
        self.state = BreakerState.CLOSED
        self.failures = 0
        self.open_until = 0.0
        self._trial_out = False
        self.opened_count = 0

    def allow(self, now: float) -> bool:
        """May a call be made now? In half-open state only the one trial call may."""
        if self.state is BreakerState.CLOSED:
            return True
        if self.state is BreakerState.OPEN:
            if now < self.open_until:
                return False
            self.state = BreakerState.HALF_OPEN
            self._trial_out = False
        if self._trial_out:
            return False
        self._trial_out = True
        return True

    def wait_s(self, now: float) -> float:
        """How long a caller refused by `allow` should wait before asking again."""
        if self.state is BreakerState.OPEN:
            return max(0.0, self.open_until - now)
        return 0.0

    def succeeded(self) -> None:
        self.state = BreakerState.CLOSED
        self.failures = 0
        self._trial_out = False

    def released(self) -> None:
        """A call that proved nothing either way (e.g. a timeout) gives the trial slot back."""
        self._trial_out = False

    def failed(self, now: float) -> bool:
        """A connection failure; returns True when this one opened the breaker."""
        self.failures += 1
        self._trial_out = False
        if self.state is BreakerState.HALF_OPEN or (
            self.state is BreakerState.CLOSED and self.failures >= self.failures_to_open
        ):
            self.state = BreakerState.OPEN
            self.open_until = now + self.cooldown_s
            self.opened_count += 1
            return True
        return False
