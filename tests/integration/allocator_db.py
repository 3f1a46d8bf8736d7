"""The allocator's handlers on real Postgres, as the bus runs them: one message, one unit of work. Shared by the
allocator's integration tests (deadlines, force-release, image events)."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import asyncpg
import pytest

from gpuaas_allocator.adapters.repository import AllocationRepository
from gpuaas_allocator.domain.model import ActiveImage
from gpuaas_allocator.service_layer.handlers import Allocator
from gpuaas_allocator.settings import AllocatorSettings
from gpuaas_common.bus import HandlerContext, deliver
from gpuaas_common.contract import Envelope
from gpuaas_common.contract import messages as m
from gpuaas_common.db import create_pool
from gpuaas_common.migrations import apply_migrations
from gpuaas_common.unit_of_work import UnitOfWork

IMAGE = ActiveImage("ubuntu-slice", "slice", "h200-sxm-slice", "a" * 64, "/img/slice.raw")
HOST_IMAGE = ActiveImage("ubuntu-host", "host", "h200-sxm", "b" * 64, "/img/host.tgz")


@pytest.fixture
async def pool(fresh_db: str) -> AsyncIterator[asyncpg.Pool]:
    conn = await asyncpg.connect(fresh_db)
    await apply_migrations(conn, "allocator", "gpuaas_allocator.migrations")
    await conn.close()
    pool = await create_pool(fresh_db, "allocator")
    yield pool
    await pool.close()


def uow(pool: asyncpg.Pool) -> UnitOfWork[AllocationRepository]:
    return UnitOfWork(pool, "allocator", "allocator", AllocationRepository)


async def send(pool: asyncpg.Pool, handler, type_: str, payload: m.Payload) -> None:
    env = Envelope.wrap(type_, payload.model_dump(mode="json"), producer="test", correlation_id="c")
    await deliver(handler, HandlerContext(env, payload, "s", "test", 1), uow(pool))


async def allocator_offering(
    pool: asyncpg.Pool, *images: ActiveImage, settings: AllocatorSettings | None = None
) -> Allocator:
    """An allocator (default settings unless given) that knows `images` (IMAGE when none are named) as active."""
    async with uow(pool) as work:
        for image in images or (IMAGE,):
            await work.repos.upsert_image(image)
        await work.commit()
    return Allocator(settings or AllocatorSettings())


async def requested(pool: asyncpg.Pool, allocator: Allocator, shape: str = "gpu_slice") -> uuid.UUID:
    """A new allocation asked for: one slice GPU on IMAGE, or a whole host on HOST_IMAGE."""
    alloc = uuid.uuid4()
    slice_ = shape == "gpu_slice"
    await send(
        pool,
        allocator.on_requested,
        "allocation.requested",
        m.AllocationRequested(
            allocation_id=alloc,
            tenant_id="t",
            shape=shape,  # type: ignore[arg-type]
            sku="h200-sxm-slice" if slice_ else "h200-sxm",
            gpu_count=1 if slice_ else 8,
            image=IMAGE.slug if slice_ else HOST_IMAGE.slug,
            ssh_public_keys=["ssh-ed25519 AAAA k@t"],
        ),
    )
    return alloc


async def placed_baremetal(pool: asyncpg.Pool, allocator: Allocator) -> uuid.UUID:
    """A baremetal allocation placed on `bm1` (MAAS system `abc123`): provisioning, its deploy command out."""
    alloc = await requested(pool, allocator, "baremetal")
    await send(
        pool,
        allocator.on_placed,
        "placement.placed",
        m.PlacementPlaced(
            allocation_id=alloc, node_id="bm1", claim_mode="node_exclusive", maas_system_id="abc123", fencing_epoch=1
        ),
    )
    return alloc


async def provisioning(pool: asyncpg.Pool, allocator: Allocator) -> uuid.UUID:
    """A slice allocation requested and placed on one slot of `n1`: provisioning, its task out."""
    alloc = await requested(pool, allocator)
    slot = m.SlotBinding(
        slot_id=f"n1-{alloc.hex[:6]}",
        gpu_pci_address="0000:18:00.0",
        nvme_by_id="nvme-x",
        fabric_vf_pci_address="0000:19:00.2",
        mac="52:54:00:00:00:01",
        private_ip="127.100.0.10",
        ovs_bridge="br-slice",
        profile="h200-slice",
    )
    await send(
        pool,
        allocator.on_placed,
        "placement.placed",
        m.PlacementPlaced(allocation_id=alloc, node_id="n1", claim_mode="slots", slots=[slot], fencing_epoch=1),
    )
    return alloc
