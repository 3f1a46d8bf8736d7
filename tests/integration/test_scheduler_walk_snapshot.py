"""A refusal holds against what the search could not see: the walk's candidate pages, and a release meanwhile.

The walk lists candidates in rank classes, sliced hosts before clean ones. A clean host that another placement
slices while the walk reads moves from a later class to an earlier one: read as one statement per class, each
with a snapshot of its own, the host is in neither answer, the walk never tries it, and a request it could take
is answered "unschedulable" (the concurrency tests' "refused yet fits"). Here the other placement commits at
exactly that moment: right after the walk's first read of the candidates.

A release that commits after the search and before the why-not answer frees a host the answer then finds passing
every rule: placement searches once more rather than refuse what fits.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import asyncpg
import pytest

from gpuaas_common.contract import messages as m
from gpuaas_common.migrations import apply_migrations
from gpuaas_common.outbox import OutboxWriter
from gpuaas_scheduler.adapters import synthetic
from gpuaas_scheduler.adapters.repository import scheduler_repositories
from gpuaas_scheduler.domain.placement import image_gate
from gpuaas_scheduler.service_layer.handlers import end_allocation
from gpuaas_scheduler.service_layer.placement import (
    Outcome,
    PlacementPolicy,
    SearchContext,
    SliceSearch,
    place,
    request_of,
)


def accepted(gpus: int) -> m.AllocationAccepted:
    return m.AllocationAccepted(
        allocation_id=uuid.uuid4(),
        tenant_id="t",
        shape="gpu_slice",
        state="accepted",
        seq=2,
        sku="h200-sxm-slice",
        gpu_count=gpus,
        region="default",
        image=m.ImageRef(slug="img", digest_sha256="0" * 64, image_path="/img"),
    )


class ThenCommitElsewhere:
    """The search's connection; once it has read its first candidates (or, `before_why_not`, just before the
    why-not answer reads the nodes), `elsewhere` runs and commits on another connection, and the search goes on."""

    def __init__(self, conn: asyncpg.Connection, elsewhere: Any, *, before_why_not: bool = False) -> None:
        self._conn, self._elsewhere, self.done = conn, elsewhere, False
        self._before_why_not = before_why_not

    def __getattr__(self, name: str) -> Any:
        return getattr(self._conn, name)

    async def _after_a_read(self, query: str) -> None:
        if not self.done and not self._before_why_not and "FROM nodes n" in query and "ORDER BY" in query:
            self.done = True
            await self._elsewhere()

    async def fetch(self, query: str, *args: Any, **kw: Any) -> list[asyncpg.Record]:
        if not self.done and self._before_why_not and "FROM nodes n ORDER BY n.node_id" in query:
            self.done = True
            await self._elsewhere()
        rows = await self._conn.fetch(query, *args, **kw)
        await self._after_a_read(query)
        return rows

    def cursor(self, query: str, *args: Any, **kw: Any) -> AsyncIterator[asyncpg.Record]:
        async def rows() -> AsyncIterator[asyncpg.Record]:
            async for row in self._conn.cursor(query, *args, **kw):
                await self._after_a_read(query)  # the first row is read: the statement has its snapshot
                yield row

        return rows()


@pytest.fixture
async def one_host(fresh_db) -> AsyncIterator[tuple[str, asyncpg.Connection, asyncpg.Connection, asyncpg.Connection]]:
    """A scheduler with one clean 8-slot host, and three connections to it: to set up, for the other placement or
    release, and for the search under test."""
    conns = [await asyncpg.connect(fresh_db, server_settings={"search_path": "scheduler"}) for _ in range(3)]
    try:
        await apply_migrations(conns[0], "scheduler", "gpuaas_scheduler.migrations")
        [node] = await synthetic.build(conns[0], slice_hosts=1)
        yield node, conns[0], conns[1], conns[2]
    finally:
        for c in conns:
            await c.close()


async def test_a_host_sliced_while_the_walk_reads_is_still_tried(one_host) -> None:
    node, setup, other, walker = one_host
    policy = PlacementPolicy()

    async def slice_it_elsewhere() -> None:
        async with other.transaction():
            assert (await place(other, accepted(1), policy)).placed is not None

    ev = accepted(1)
    req = request_of(ev)
    req = replace(req, image_gate=image_gate(ev.image.slug, ev.image.digest_sha256, False))
    conn = ThenCommitElsewhere(walker, slice_it_elsewhere)
    out = Outcome()
    async with walker.transaction():
        taken = await SliceSearch(conn, SearchContext.gather(ev, req, policy), out).walk_candidates()  # type: ignore[arg-type]
    assert conn.done, "the other placement never ran: the walk read no candidates"
    assert taken and out.placed is not None and out.placed.node_id == node
    free = await setup.fetchval("SELECT free_slots FROM nodes WHERE node_id = $1", node)
    assert free == 6


async def test_a_host_freed_before_the_refusal_is_written_is_taken(one_host) -> None:
    node, setup, other, placer = one_host
    policy = PlacementPolicy()
    whole = accepted(8)
    async with setup.transaction():
        assert (await place(setup, whole, policy)).placed is not None

    async def release_elsewhere() -> None:
        async with other.transaction():
            freed = await end_allocation(
                scheduler_repositories(other),
                whole.allocation_id,
                "released",
                cleanup_required=False,
                reason=None,
                wipe_proofs=[],
                events=OutboxWriter(other, "scheduler", "scheduler"),
            )
            assert freed == 8

    conn = ThenCommitElsewhere(placer, release_elsewhere, before_why_not=True)
    async with placer.transaction():
        out = await place(conn, accepted(1), policy)  # type: ignore[arg-type]
    assert conn.done, "the search never asked why not: the host was not full"
    assert out.placed is not None and out.placed.node_id == node, out.unschedulable
