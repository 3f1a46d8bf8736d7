"""A fixture's teardown step that cannot hang the suite: it gets a deadline, and past it every task still pending
on the loop is printed with its stack (what the step waits on), then the step's own name is the failure. pytest's
timeout would end it too, but only after the whole item's budget and without saying which task held it."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable

TEARDOWN_S = 30.0


async def bounded(step: str, work: Awaitable[object], timeout_s: float = TEARDOWN_S) -> None:
    try:
        await asyncio.wait_for(work, timeout_s)
    except TimeoutError:
        current = asyncio.current_task()
        for task in asyncio.all_tasks():
            if task is not current:
                print(f"--- pending at teardown: {task.get_name()} {task!r}", file=sys.stderr)
                task.print_stack(file=sys.stderr)
        raise AssertionError(f"teardown step {step!r} did not finish in {timeout_s:.0f} s") from None
