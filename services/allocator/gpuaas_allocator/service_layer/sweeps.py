"""The shape every allocator sweep shares: take the due rows in batches, act on each, commit per batch."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from gpuaas_common.bus import HandlerContext

Row = dict[str, Any]


async def sweep_in_batches(
    uow_factory: Callable[[], Any],
    consumer: str,
    lock_due: Callable[[Any, int], Awaitable[list[Row]]],
    act: Callable[[HandlerContext, Row], Awaitable[None]],
    *,
    batch: int = 50,
) -> int:
    """`lock_due(repos, limit)` takes due rows with SKIP LOCKED, so replicas share the work and a row a handler
    holds is left alone; each batch is one unit of work, its events go out through the outbox as a handler's
    would (with no causing message: `consumer` names the sweep). How many rows were acted on."""
    total = 0
    while True:
        async with uow_factory() as uow:
            rows = await lock_due(uow.repos, batch)
            ctx = HandlerContext(None, None, "", consumer, 0, uow)  # type: ignore[arg-type]
            for row in rows:
                await act(ctx, row)
            await uow.commit()
        total += len(rows)
        if len(rows) < batch:
            return total
