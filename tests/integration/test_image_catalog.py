"""Catalog rules against a real Postgres: seed re-application never reverts a materialised digest, and the
activation gate opens only when every known slice host verified the catalog digest, and a retired host leaves it."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import asyncpg

from gpuaas_common.contract import messages as m
from gpuaas_common.migrations import apply_migrations
from gpuaas_common.unit_of_work import UnitOfWork
from gpuaas_image_pipeline.adapters.repository import image_pipeline_repositories
from gpuaas_image_pipeline.domain.catalog import SeedImage
from gpuaas_image_pipeline.service_layer import catalog
from gpuaas_image_pipeline.service_layer.seeding import apply_seed

SCHEMA = "image_pipeline"
SEED_DIGEST = "0" * 64
BUILT_DIGEST = "b" * 64


async def _connect(dsn: str) -> tuple[asyncpg.Connection, asyncpg.Pool]:
    conn = await asyncpg.connect(dsn, server_settings={"search_path": SCHEMA})
    await apply_migrations(conn, SCHEMA, "gpuaas_image_pipeline.migrations")
    pool = await asyncpg.create_pool(dsn, min_size=1, max_size=2, server_settings={"search_path": SCHEMA})
    return conn, pool


def _uow(pool: asyncpg.Pool) -> UnitOfWork:
    return UnitOfWork(pool, SCHEMA, "image-pipeline", image_pipeline_repositories)


async def _published(conn: asyncpg.Connection, slug: str) -> None:
    """A slice image the pipeline built and published: in the catalog, waiting on the activation gate."""
    meta = {
        "image_path": f"/var/lib/gpuaas/slice-images/{slug}.raw",
        "artifact_ref": "oci://r/ns/img:t@sha256:" + "1" * 64,
        "blob_digest": "sha256:" + "2" * 64,
        "blob_size": 10,
        "blob_media_type": "x",
        "virtual_size": 100,
        "registry_tls": "plain-http",
    }
    await conn.execute(
        "INSERT INTO os_images (slug, kind, status, compatible_sku, digest_sha256, metadata) "
        "VALUES ($1, 'slice', 'published', 'h200-sxm-slice', $2, $3)",
        slug,
        BUILT_DIGEST,
        json.dumps(meta),
    )


def _seed(**kw) -> SeedImage:
    return SeedImage(
        slug="ubuntu-24.04-h200-cuda",
        kind="slice",
        sku="h200-sxm-slice",
        digest_sha256=SEED_DIGEST,
        image_path="/var/lib/gpuaas/slice-images/ubuntu-24.04-h200-cuda.raw",
        **kw,
    )


async def test_seed_reapplication_keeps_materialised_digest_and_status(fresh_db: str) -> None:
    conn, pool = await _connect(fresh_db)
    try:
        async with _uow(pool) as uow:
            await apply_seed(uow, [_seed()])
            await uow.commit()
        # A build materialised a real digest and the operator disabled it meanwhile.
        await conn.execute(
            "UPDATE os_images SET digest_sha256 = $1, status = 'disabled', source_uri = 'oci://r/x:1' "
            "WHERE slug = 'ubuntu-24.04-h200-cuda'",
            BUILT_DIGEST,
        )
        async with _uow(pool) as uow:
            active = await apply_seed(uow, [_seed(source_uri="file://x")])
            await uow.commit()
        row = await conn.fetchrow("SELECT * FROM os_images WHERE slug = 'ubuntu-24.04-h200-cuda'")
        assert (row["digest_sha256"], row["status"], row["source_uri"]) == (BUILT_DIGEST, "disabled", "oci://r/x:1")
        assert active == []
    finally:
        await pool.close()
        await conn.close()


async def test_gate_needs_every_known_host_verified_with_the_catalog_digest(fresh_db: str) -> None:
    conn, pool = await _connect(fresh_db)
    slug = "img"
    try:
        await _published(conn, slug)
        async with _uow(pool) as uow:
            for node in ("n1", "n2"):
                sent = await catalog.on_enrolled(
                    uow, m.NodeEnrolled(node_id=node, kind="slice_host", hostname=node, agent_version="t"), f"ev-{node}"
                )
                assert sent == 1
            await uow.commit()

        async def report(node: str, status: str, digest: str) -> str:
            async with _uow(pool) as uow:
                await catalog.on_cache_reported(
                    uow,
                    m.NodeImageCacheReported(
                        task_id="t",
                        node_id=node,
                        slug=slug,
                        status=status,
                        expected_digest=BUILT_DIGEST,
                        digest_sha256=digest,
                        local_path="/x",
                    ),
                )
                await uow.commit()
            return await conn.fetchval("SELECT status FROM os_images WHERE slug = $1", slug)

        assert await report("n1", "verified", BUILT_DIGEST) == "published"
        # A "verified" verdict with another digest counts as a mismatch.
        assert await report("n2", "verified", "c" * 64) == "published"
        assert await conn.fetchval("SELECT status FROM node_image_cache WHERE node_id = 'n2'") == "mismatch"
        assert await report("n2", "verified", BUILT_DIGEST) == "active"
        events = [json.loads(bytes(r["body"]))["type"] for r in await conn.fetch("SELECT body FROM outbox ORDER BY id")]
        assert events.count("image.cache_prewarm") == 2 and events.count("image.activated") == 1
    finally:
        await pool.close()
        await conn.close()


async def test_seeding_asks_known_hosts_to_check_a_seeded_slice_image(fresh_db: str) -> None:
    conn, pool = await _connect(fresh_db)
    try:
        async with _uow(pool) as uow:
            for node in ("n1", "n2"):
                enrolled = m.NodeEnrolled(node_id=node, kind="slice_host", hostname=node, agent_version="t")
                assert await catalog.on_enrolled(uow, enrolled, f"ev-{node}") == 0  # nothing catalogued yet
            host_seed = SeedImage(
                slug="host-img", kind="host", sku="h200-sxm", digest_sha256="e" * 64, image_path="custom/host-img"
            )
            await apply_seed(uow, [_seed(), host_seed])
            await uow.commit()

        async def tasks() -> list[dict]:
            rows = await conn.fetch("SELECT body FROM outbox ORDER BY id")
            bodies = [json.loads(bytes(r["body"])) for r in rows]
            return [b["payload"] for b in bodies if b["type"] == "image.cache_prewarm"]

        sent = await tasks()
        # A check, not a pull: the seeded row has no artifact, and the host image lives in MAAS.
        assert sorted(t["node_id"] for t in sent) == ["n1", "n2"]
        assert {(t["slug"], t["digest_sha256"], t["artifact_ref"]) for t in sent} == {(_seed().slug, SEED_DIGEST, None)}
        assert await conn.fetchval("SELECT count(*) FROM node_image_cache") == 0  # nothing is pulling

        async with _uow(pool) as uow:
            await catalog.on_cache_reported(
                uow,
                m.NodeImageCacheReported(
                    task_id=sent[0]["task_id"], node_id="n1", slug=_seed().slug, status="verified",
                    expected_digest=SEED_DIGEST, digest_sha256=SEED_DIGEST, local_path=_seed().image_path,
                ),
            )  # fmt: skip
            await catalog.on_cache_reported(
                uow,
                m.NodeImageCacheReported(
                    task_id=sent[1]["task_id"], node_id="n2", slug=_seed().slug, status="absent",
                    expected_digest=SEED_DIGEST, digest_sha256=None, local_path=_seed().image_path,
                    reason="not in this host's cache",
                ),
            )  # fmt: skip
            await uow.commit()
        caches = {r["node_id"]: (r["status"], r["reason"]) for r in await conn.fetch("SELECT * FROM node_image_cache")}
        assert caches == {"n1": ("verified", None), "n2": ("absent", "not in this host's cache")}

        # The next start of the pipeline asks again only the host that does not hold it verified.
        async with _uow(pool) as uow:
            await apply_seed(uow, [_seed(), host_seed])
            await uow.commit()
        assert [t["node_id"] for t in (await tasks())[2:]] == ["n2"]
    finally:
        await pool.close()
        await conn.close()


async def test_a_retired_host_leaves_the_gate_and_the_image_waiting_only_on_it_activates(fresh_db: str) -> None:
    """One dead host blocked every activation for good (issue 26): the scheduler's `scheduler.host_mode_changed`
    to retired (or baremetal) takes it out of the gate's hosts, and a published image every remaining host has
    verified activates at once. Other modes (converting, drained) leave the gate as it is."""
    conn, pool = await _connect(fresh_db)
    slug = "img"
    try:
        await _published(conn, slug)
        async with _uow(pool) as uow:
            for node in ("alive", "dead"):
                enrolled = m.NodeEnrolled(node_id=node, kind="slice_host", hostname=node, agent_version="t")
                await catalog.on_enrolled(uow, enrolled, f"ev-{node}")
            await catalog.on_cache_reported(
                uow,
                m.NodeImageCacheReported(
                    task_id="t",
                    node_id="alive",
                    slug=slug,
                    status="verified",
                    expected_digest=BUILT_DIGEST,
                    digest_sha256=BUILT_DIGEST,
                    local_path="/x",
                ),
            )
            await uow.commit()
        status = "SELECT status FROM os_images WHERE slug = $1"
        assert await conn.fetchval(status, slug) == "published"  # "dead" never answers

        async def moved(to_mode: str) -> bool:
            async with _uow(pool) as uow:
                left = await catalog.on_host_mode_changed(
                    uow,
                    m.HostModeChanged(
                        node_id="dead",
                        from_mode="drained",
                        to_mode=to_mode,  # type: ignore[arg-type]
                        actor="alice",
                        reason="chassis gone",
                        changed_at=datetime.now(UTC),
                    ),
                )
                await uow.commit()
            return left

        for mode in ("converting", "drained"):
            assert not await moved(mode)
        assert await conn.fetchval(status, slug) == "published"
        assert await moved("retired")
        assert await conn.fetchval(status, slug) == "active"
        assert [r["node_id"] for r in await conn.fetch("SELECT node_id FROM slice_hosts")] == ["alive"]
        assert not await moved("retired")  # a repeat changes nothing
        events = [json.loads(bytes(r["body"]))["type"] for r in await conn.fetch("SELECT body FROM outbox ORDER BY id")]
        assert events.count("image.activated") == 1
    finally:
        await pool.close()
        await conn.close()


async def test_a_seeded_slice_image_is_active_only_once_every_slice_host_verified_it(fresh_db: str) -> None:
    """Issue 38: a seeded slice image was announced `active` at seeding with no host verified. It passes the
    gate as a built image does: published, no image.activated, until the last slice host verified its digest;
    a seeded host image (it lives in MAAS) is active at once."""
    conn, pool = await _connect(fresh_db)
    try:
        async with _uow(pool) as uow:
            for node in ("n1", "n2"):
                enrolled = m.NodeEnrolled(node_id=node, kind="slice_host", hostname=node, agent_version="t")
                await catalog.on_enrolled(uow, enrolled, f"ev-{node}")
            host_seed = SeedImage(
                slug="host-img", kind="host", sku="h200-sxm", digest_sha256="e" * 64, image_path="custom/host-img"
            )
            assert await apply_seed(uow, [_seed(), host_seed]) == ["host-img"]
            await uow.commit()

        async def activated() -> list[str]:
            rows = await conn.fetch("SELECT body FROM outbox ORDER BY id")
            bodies = [json.loads(bytes(r["body"])) for r in rows]
            return [b["payload"]["slug"] for b in bodies if b["type"] == "image.activated"]

        status = "SELECT status FROM os_images WHERE slug = $1"
        assert await conn.fetchval(status, _seed().slug) == "published"
        assert await activated() == ["host-img"]

        async def verified(node: str) -> str:
            async with _uow(pool) as uow:
                await catalog.on_cache_reported(
                    uow,
                    m.NodeImageCacheReported(
                        task_id=f"t-{node}", node_id=node, slug=_seed().slug, status="verified",
                        expected_digest=SEED_DIGEST, digest_sha256=SEED_DIGEST, local_path=_seed().image_path,
                    ),
                )  # fmt: skip
                await uow.commit()
            return str(await conn.fetchval(status, _seed().slug))

        assert await verified("n1") == "published" and await activated() == ["host-img"]
        assert await verified("n2") == "active"
        assert await activated() == ["host-img", _seed().slug]
    finally:
        await pool.close()
        await conn.close()
