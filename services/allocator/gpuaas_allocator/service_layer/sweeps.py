"""The shape every allocator sweep shares: take the due allocations in batches, ask each to do one thing,
commit per batch."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from ..domain.allocation import Allocation
from ..domain.commands import Policy
from .commands import save
from .ports import AllocatorRepositories, AllocatorUnitOfWork, Row, UnitOfWorkFactory

# One allocation's turn in a sweep, in the batch's unit of work.
Act = Callable[[AllocatorUnitOfWork, Allocation], Awaitable[None]]


async def sweep_in_batches(
    uow_factory: UnitOfWorkFactory,
    policy: Policy,
    lock_due: Callable[[AllocatorRepositories, int], Awaitable[list[Row]]],
    act: Act,
    *,
    batch: int = 50,
) -> int:
    """`lock_due(repos, limit)` takes due rows with SKIP LOCKED, so replicas share the work and a row a handler
    holds is left alone; each batch is one unit of work, its events go out through the outbox as a handler's
    would, caused by no message. `act(uow, allocation)` asks the allocation; it is saved after. How many
    allocations were acted on."""
    total = 0
    while True:
        async with uow_factory() as uow:
            rows = await lock_due(uow.repos, batch)
            for row in rows:
                alloc = uow.repos.aggregate(row, policy)
                await act(uow, alloc)
                await save(uow, alloc)
            await uow.commit()
        total += len(rows)
        if len(rows) < batch:
            return total
