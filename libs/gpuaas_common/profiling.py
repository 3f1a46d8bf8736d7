"""Opt-in CPU profile of a whole service process, for finding where the cost per message goes.

`GPUAAS_PROFILE_DIR=<dir>` runs the process under cProfile and writes `<dir>/<service>-<pid>.prof` when it
stops (read it with `python -m pstats`). Off unless set: cProfile roughly doubles the cost of Python code.
Only the main thread is profiled, which is where the event loop and every handler run.

`GPUAAS_PROFILE_CLOCK=cpu` times the profile by the process's CPU clock instead of the wall clock: on a busy
host a wall-clock profile charges a function for the time the process waited to run again after it (a write to
a socket that wakes the reader), which reads as cost where there was none.
"""

from __future__ import annotations

import cProfile
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")

ENV = "GPUAAS_PROFILE_DIR"
CLOCK_ENV = "GPUAAS_PROFILE_CLOCK"


def profiled(name: str, fn: Callable[[], T]) -> T:
    """`fn()`, under cProfile when GPUAAS_PROFILE_DIR is set; the profile is written even if it raises."""
    where = os.environ.get(ENV)
    if not where:
        return fn()
    profiler = cProfile.Profile(time.process_time) if os.environ.get(CLOCK_ENV) == "cpu" else cProfile.Profile()
    profiler.enable()
    try:
        return fn()
    finally:
        profiler.disable()
        path = Path(where)
        path.mkdir(parents=True, exist_ok=True)
        profiler.dump_stats(str(path / f"{name}-{os.getpid()}.prof"))
