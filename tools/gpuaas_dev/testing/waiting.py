"""Wait for an observable condition with a deadline (instead of sleeping a guessed time)."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any


async def eventually(
    predicate: Callable[[], Any], timeout: float = 30.0, interval: float = 0.05, what: str = "condition"
) -> Any:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        result = predicate()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return result
        if loop.time() >= deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(interval)


async def service_ready(ready: Path, proc: asyncio.subprocess.Process, log: Path, timeout: float = 60.0) -> None:
    """Wait for a service process to write its ready file (it does once every readiness check passes); fail at
    once, with the end of its log, if it exits first."""
    await eventually(lambda: ready.exists() or proc.returncode is not None, timeout=timeout, what=f"{ready.name}")
    if proc.returncode is not None:
        tail = (await asyncio.to_thread(log.read_text))[-3000:]
        raise AssertionError(f"exited {proc.returncode} before ready: {tail}")
