"""Image pipeline replicas share the builds table: a replica starting up (or sweeping) fails only builds
whose process is gone, never a build another replica is running."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import asyncpg
import pytest
import pytest_asyncio

from gpuaas_common.db import create_pool
from gpuaas_common.migrations import apply_migrations
from gpuaas_dev.testing.waiting import eventually
from gpuaas_image_pipeline.adapters import qemu
from gpuaas_image_pipeline.domain.catalog import BuildRequest
from gpuaas_image_pipeline.entrypoints.build_runner import build_runner
from gpuaas_image_pipeline.settings import ImagePipelineSettings


@pytest_asyncio.fixture
async def pool(fresh_db: str) -> AsyncIterator[asyncpg.Pool]:
    conn = await asyncpg.connect(fresh_db)
    await apply_migrations(conn, "image_pipeline", "gpuaas_image_pipeline.migrations")
    await conn.close()
    p = await create_pool(fresh_db, "image_pipeline", min_size=1, max_size=10)
    yield p
    await p.close()


class HeldCustomiser:
    """Stands in for the customise phase, held until the test lets it go (the build is running then)."""

    name = "none"

    def __init__(self) -> None:
        self.entered = asyncio.Event()
        self.door = asyncio.Event()

    def plan(self, image: Path, packages: list[str]) -> list[str]:
        return ["held customise"]

    async def customise(self, image: Path, packages: list[str], stamp: dict[str, Any]) -> None:
        self.entered.set()
        await self.door.wait()


async def test_a_starting_replica_fails_only_builds_whose_replica_is_gone(
    pool: asyncpg.Pool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    held = HeldCustomiser()
    monkeypatch.setitem(qemu.CUSTOMISERS, "none", held)
    source = tmp_path / "source.qcow2"
    proc = await asyncio.create_subprocess_exec("qemu-img", "create", "-q", "-f", "qcow2", str(source), "1M")
    assert await proc.wait() == 0
    settings = ImagePipelineSettings(
        registry_host="127.0.0.1:9",
        image_build_dir=str(tmp_path / "builds"),
        image_source_dirs=str(tmp_path),
        image_customise="none",
    )
    running = build_runner(pool, None, settings, lease_s=1.0)
    build = await running.start("slice-replica-test", BuildRequest(source=str(source)))
    build_id = build["build_id"]
    await asyncio.wait_for(held.entered.wait(), timeout=30)

    async def status() -> str:
        return str(await pool.fetchval("SELECT status FROM builds WHERE build_id = $1", build_id))

    # A second replica starts while the build runs: the build is live (its lease is renewed), left alone.
    starting = build_runner(pool, None, settings, lease_s=1.0)
    assert await starting.recover() == 0
    assert await status() == "customising"
    lease_until = await pool.fetchval("SELECT lease_until FROM builds WHERE build_id = $1", build_id)
    # Renewed while it runs: the lease moves past the one it was started with.
    await eventually(
        lambda: _lease_moved(pool, build_id, lease_until), timeout=10, interval=0.05, what="the lease renewed"
    )
    assert await starting.recover() == 0

    # The running replica dies: its task stops, nothing renews the lease; once it has run out, the other
    # replica fails the build.
    task = running.tasks[build_id]
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert await status() == "customising"
    last_lease = await pool.fetchval("SELECT lease_until FROM builds WHERE build_id = $1", build_id)
    assert await eventually(lambda: starting.recover(), timeout=10, interval=0.05, what="the build taken over") == 1
    row = await pool.fetchrow("SELECT * FROM builds WHERE build_id = $1", build_id)
    assert row["status"] == "failed" and row["error"].startswith("interrupted")
    assert row["updated_at"] >= last_lease and row["lease_owner"] is None


async def _lease_moved(pool: asyncpg.Pool, build_id: str, before: Any) -> bool:
    return bool(await pool.fetchval("SELECT lease_until > $2 FROM builds WHERE build_id = $1", build_id, before))


class FailingCustomiser(HeldCustomiser):
    async def customise(self, image: Path, packages: list[str], stamp: dict[str, Any]) -> None:
        raise qemu.ImageToolError("customise failed on purpose")


async def test_a_build_that_ends_gives_its_lease_back(
    pool: asyncpg.Pool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(qemu.CUSTOMISERS, "none", FailingCustomiser())
    source = tmp_path / "source.qcow2"
    proc = await asyncio.create_subprocess_exec("qemu-img", "create", "-q", "-f", "qcow2", str(source), "1M")
    assert await proc.wait() == 0
    settings = ImagePipelineSettings(
        registry_host="127.0.0.1:9",
        image_build_dir=str(tmp_path / "builds"),
        image_source_dirs=str(tmp_path),
        image_customise="none",
    )
    runner = build_runner(pool, None, settings, lease_s=1.0)
    build = await runner.start("slice-replica-test", BuildRequest(source=str(source)))
    await asyncio.wait_for(runner.tasks[build["build_id"]], timeout=60)
    row = await pool.fetchrow("SELECT * FROM builds WHERE build_id = $1", build["build_id"])
    assert row["status"] == "failed" and "customise failed on purpose" in row["error"], row["error"]
    assert (row["lease_owner"], row["lease_until"]) == (None, None)
    assert await build_runner(pool, None, settings, lease_s=1.0).recover() == 0
