"""A hostile input image (issue 38, N5a): a qcow2 whose header names a file of the build host, as a backing
file or as an external data file, is refused before any tool converts it, so no byte of that file reaches a
build's work files, its artifact or the catalog. The format is the request's, never probed."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import asyncpg
import pytest
import pytest_asyncio

from gpuaas_common.db import create_pool
from gpuaas_common.migrations import apply_migrations
from gpuaas_image_pipeline.adapters import qemu
from gpuaas_image_pipeline.domain.catalog import BuildRequest
from gpuaas_image_pipeline.entrypoints.build_runner import build_runner
from gpuaas_image_pipeline.settings import ImagePipelineSettings

# What a host file holds: a build that copied it would carry these bytes into the image.
HOST_SECRET = b"-----BEGIN NATS USER JWT----- build host credentials, never in an image\n"


@pytest_asyncio.fixture
async def pool(fresh_db: str) -> AsyncIterator[asyncpg.Pool]:
    conn = await asyncpg.connect(fresh_db)
    await apply_migrations(conn, "image_pipeline", "gpuaas_image_pipeline.migrations")
    await conn.close()
    p = await create_pool(fresh_db, "image_pipeline", min_size=1, max_size=5)
    yield p
    await p.close()


async def _qemu_img(*argv: str) -> None:
    proc = await asyncio.create_subprocess_exec("qemu-img", *argv)
    assert await proc.wait() == 0, argv


@pytest.fixture
def host_file(tmp_path: Path) -> Path:
    """A file of the build host (outside every build directory), padded to a whole MiB of image."""
    secret = tmp_path / "host" / "image-pipeline.creds"
    secret.parent.mkdir()
    secret.write_bytes(HOST_SECRET.ljust(1 << 20, b"\0"))
    return secret


def _files_holding(root: Path, needle: bytes) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file() and needle in p.read_bytes()]


async def _build(pool: asyncpg.Pool, tmp_path: Path, req: BuildRequest) -> asyncpg.Record:
    settings = ImagePipelineSettings(
        registry_host="127.0.0.1:9",
        image_build_dir=str(tmp_path / "builds"),
        image_source_dirs=str(tmp_path / "sources"),
        image_customise="none",
    )
    runner = build_runner(pool, None, settings, lease_s=5.0)
    build = await runner.start("slice-hostile", req)
    await asyncio.wait_for(runner.tasks[build["build_id"]], timeout=60)
    row = await pool.fetchrow("SELECT * FROM builds WHERE build_id = $1", build["build_id"])
    assert row is not None
    return row


@pytest.mark.parametrize(
    ("options", "code"),
    [
        pytest.param("-b {host} -F raw", "image_backing_file_refused", id="backing-file"),
        pytest.param("-o data_file={host},data_file_raw=on", "image_data_file_refused", id="external-data-file"),
    ],
)
async def test_a_qcow2_naming_a_host_file_is_refused_before_any_conversion(
    pool: asyncpg.Pool, tmp_path: Path, host_file: Path, options: str, code: str
) -> None:
    sources = tmp_path / "sources"
    sources.mkdir()
    vendor = sources / "vendor.qcow2"
    await _qemu_img("create", "-q", "-f", "qcow2", *options.format(host=host_file).split(), str(vendor), "1M")

    row = await _build(pool, tmp_path, BuildRequest(source=str(vendor)))

    assert row["status"] == "failed"
    assert row["error"].startswith(f"ImageRefused: {code}: the qcow2 image names "), row["error"]
    assert "\n" not in row["error"]
    # Nothing was converted: no work file at all, and no byte of the host file anywhere under the builds.
    assert [p.name for p in (tmp_path / "builds").rglob("*") if p.is_file()] == []
    assert _files_holding(tmp_path / "builds", HOST_SECRET[:32]) == []
    assert row["raw_sha256"] is None and row["artifact_path"] is None
    assert await pool.fetchval("SELECT count(*) FROM os_images") == 0
    assert await pool.fetchval("SELECT count(*) FROM outbox") == 0


async def test_the_format_is_the_requests_never_probed(pool: asyncpg.Pool, tmp_path: Path, host_file: Path) -> None:
    """A qcow2 presented as raw is read as raw bytes (its backing file never opened); a raw file presented
    as qcow2 is refused in one line."""
    sources = tmp_path / "sources"
    sources.mkdir()
    vendor = sources / "vendor.img"
    await _qemu_img("create", "-q", "-f", "qcow2", "-b", str(host_file), "-F", "raw", str(vendor), "1M")
    info = await qemu.checked_input(vendor, "raw")
    assert info["format"] == "raw" and "backing-filename" not in info

    plain = sources / "plain.img"
    plain.write_bytes(b"\0" * (1 << 20))
    row = await _build(pool, tmp_path, BuildRequest(source=str(plain), source_format="qcow2"))
    assert row["status"] == "failed"
    assert row["error"].startswith("ImageRefused: image_unreadable: not a qcow2 image qemu-img can open: "), row[
        "error"
    ]
    assert "\n" not in row["error"]


async def test_qemu_img_runs_under_resource_limits(tmp_path: Path) -> None:
    """prlimit holds every qemu-img run: a limit too small to start the tool fails the run, with the tool's
    own error, instead of letting it grow."""
    image = tmp_path / "small.qcow2"
    await _qemu_img("create", "-q", "-f", "qcow2", str(image), "1M")
    assert (await qemu.image_info(image, "qcow2"))["format"] == "qcow2"
    with pytest.raises(qemu.ImageToolError):
        await qemu.image_info(image, "qcow2", qemu.ToolLimits(address_space_bytes=16 << 20, cpu_seconds=10))
