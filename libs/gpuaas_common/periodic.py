"""Background rounds that run until their task is cancelled: deadline sweeps and audits."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from .cancellation import stop_if_cancelled
from .db import DB_UNAVAILABLE
from .logging import get_logger

log = get_logger(__name__)


async def every(interval_s: float, round_: Callable[[], Awaitable[object]], name: str) -> None:
    """Run `round_` every `interval_s` seconds for good. A round that meets no database is logged and tried
    again at the next one: the database coming back is the recovery, not a restart of the service."""
    while True:
        stop_if_cancelled()
        try:
            await round_()
        except DB_UNAVAILABLE as exc:
            log.warning(f"{name}_failed", error=str(exc)[:300])
        await asyncio.sleep(interval_s)
