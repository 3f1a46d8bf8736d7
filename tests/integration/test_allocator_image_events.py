"""The allocator's view of the active images when replicas handle one slug's events out of order.

Replicas share the allocator-images durable: an image.activated and the image.deactivated published after
it can be handled by two replicas at once and commit in either order. The later event must win.
"""

from __future__ import annotations

import asyncio
from datetime import datetime, timedelta, timezone

import asyncpg

from gpuaas_allocator.service_layer.handlers import Allocator
from gpuaas_allocator.settings import AllocatorSettings
from gpuaas_common.bus import HandlerContext, deliver
from gpuaas_common.contract import Envelope
from gpuaas_common.contract import messages as m
from gpuaas_dev.testing.waiting import eventually

from .allocator_db import pool, uow  # noqa: F401 (fixture)

T0 = datetime.now(timezone.utc) - timedelta(minutes=5)
SLUG = "ubuntu-slice"


def activated(digest: str) -> m.ImageActivated:
    return m.ImageActivated(
        slug=SLUG, kind="slice", sku="h200-sxm-slice", digest_sha256=digest, image_path="/img/slice.raw"
    )


def context(type_: str, payload: m.Payload, at: datetime) -> HandlerContext:
    env = Envelope.wrap(type_, payload.model_dump(mode="json"), producer="image-pipeline", correlation_id="c")
    env = env.model_copy(update={"occurred_at": at})
    return HandlerContext(env, payload, "s", "allocator-images", 1)


async def active(pool: asyncpg.Pool) -> list[tuple[str, str]]:  # noqa: F811
    return [(r["slug"], r["digest_sha256"]) for r in await pool.fetch("SELECT slug, digest_sha256 FROM active_images")]


async def test_a_deactivation_handled_before_the_older_activation_wins(pool: asyncpg.Pool) -> None:  # noqa: F811
    allocator = Allocator(AllocatorSettings())
    deactivated = m.ImageDeactivated(slug=SLUG, reason="new digest is being prewarmed")
    # Published: activated (t0), then deactivated (t0 + 1 s). Handled the other way round.
    assert await deliver(
        allocator.on_image_deactivated, context("image.deactivated", deactivated, T0 + timedelta(seconds=1)), uow(pool)
    )
    assert await deliver(allocator.on_image_activated, context("image.activated", activated("a" * 64), T0), uow(pool))
    assert await active(pool) == []

    # A newer activation (the new digest verified everywhere) applies.
    assert await deliver(
        allocator.on_image_activated,
        context("image.activated", activated("b" * 64), T0 + timedelta(seconds=2)),
        uow(pool),
    )
    assert await active(pool) == [(SLUG, "b" * 64)]


async def test_two_replicas_on_one_slug_run_one_after_the_other(pool: asyncpg.Pool) -> None:  # noqa: F811
    one, two = Allocator(AllocatorSettings()), Allocator(AllocatorSettings())
    first = uow(pool)
    async with first:
        ctx = context("image.activated", activated("c" * 64), T0 + timedelta(seconds=3))
        ctx.uow = first
        await one.on_image_activated(ctx)
        # While the first replica's transaction is open, the second handles an older deactivation.
        older = context("image.deactivated", m.ImageDeactivated(slug=SLUG, reason="old"), T0)
        second = asyncio.ensure_future(deliver(two.on_image_deactivated, older, uow(pool)))

        async def waiting() -> bool:
            return bool(
                await pool.fetchval(
                    "SELECT count(*) FROM pg_stat_activity "
                    "WHERE wait_event_type = 'Lock' AND datname = current_database()"
                )
            )

        await eventually(waiting, timeout=10, interval=0.01, what="the second replica waiting on the slug")
        await first.commit()
    assert await second
    assert await active(pool) == [(SLUG, "c" * 64)]
