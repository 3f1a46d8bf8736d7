"""The stack is synchronous; its few async steps (database, stream provisioning) run through here."""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable, Coroutine
from typing import Any


def run_coro(factory: Callable[[], Coroutine[Any, Any, Any]]) -> Any:
    # A thread of its own: the caller may already be inside a running loop (pytest-asyncio, bench).
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, factory()).result()
