"""A guard for loops that run until their task is cancelled."""

from __future__ import annotations

import asyncio


def stop_if_cancelled() -> None:
    """Raise CancelledError when this task was asked to stop but the cancellation got lost on the way.

    Before Python 3.12, `asyncio.wait_for` hands back the inner result when a cancel arrives just as that result
    does, and the cancel is gone (CPython gh-86296; nats-py and our own subprocess calls use it). A loop that only
    ends on CancelledError then runs on for good and whoever awaits it at shutdown waits for good: a node agent's
    reconciler did exactly that in the test suite. Called once per round, the loop stops at its next round.
    """
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError
