"""A loop that runs until cancelled stops even when asyncio.wait_for drops the cancel (CPython gh-86296)."""

from __future__ import annotations

import asyncio
import sys

import pytest

from gpuaas_common.cancellation import stop_if_cancelled


async def _rounds(futures: asyncio.Queue[asyncio.Future[int]], guarded: bool) -> None:
    while True:
        if guarded:
            stop_if_cancelled()
        fut: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        await futures.put(fut)
        await asyncio.wait_for(fut, 10)


async def _cancel_as_the_result_lands(guarded: bool) -> tuple[asyncio.Task[None], bool]:
    """Cancel the loop in the same step its awaited result lands (the race the reconciler lost in the suite);
    says whether it went on to a further round."""
    futures: asyncio.Queue[asyncio.Future[int]] = asyncio.Queue()
    task = asyncio.create_task(_rounds(futures, guarded))
    first = await futures.get()
    first.set_result(1)
    task.cancel()
    getting = asyncio.create_task(futures.get())
    await asyncio.wait({task, getting}, return_when=asyncio.FIRST_COMPLETED)
    went_on = getting.done()
    getting.cancel()
    if went_on:
        task.cancel()  # the dropped cancel: only a second one stops the unguarded loop
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, 5)
    return task, went_on


async def test_a_guarded_loop_stops_after_a_cancel_that_wait_for_dropped() -> None:
    task, went_on = await _cancel_as_the_result_lands(guarded=True)
    assert task.cancelled() and not went_on


async def test_without_the_guard_this_python_drops_that_cancel() -> None:
    """Pins why the guard exists: before 3.12 the unguarded loop starts a further round after being cancelled."""
    _task, went_on = await _cancel_as_the_result_lands(guarded=False)
    assert went_on is (sys.version_info < (3, 12))
