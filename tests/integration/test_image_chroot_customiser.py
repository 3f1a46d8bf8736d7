"""The chroot customiser on a real image: the lab's Debian 12 base (built once per recipe into the user's
cache), packages installed from the archive with the guest's apt, the result read back from the disk.

Needs root, loop devices and the Debian archive, as the image pipeline's build hosts do; on a machine
without them these tests fail, they do not skip.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import subprocess
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aiohttp
import asyncpg
import pytest
import pytest_asyncio

from gpuaas_common.db import create_pool
from gpuaas_common.migrations import apply_migrations
from gpuaas_dev.lab.base_image import ensure_base_image, serve_directory
from gpuaas_dev.testing.servers import RegistryServer
from gpuaas_image_pipeline.adapters import customise_chroot, qemu
from gpuaas_image_pipeline.adapters.customise_chroot import CustomiseError, installed_versions
from gpuaas_image_pipeline.domain.catalog import BuildRequest
from gpuaas_image_pipeline.entrypoints.build_runner import build_runner
from gpuaas_image_pipeline.service_layer.builds import BuildRunner
from gpuaas_image_pipeline.settings import ImagePipelineSettings


def _attached() -> tuple[str, str]:
    """Loop devices and mounts of the whole machine, as text to compare before and after."""
    loops = subprocess.run(["losetup", "-a"], capture_output=True, text=True, check=True).stdout
    return "\n".join(sorted(loops.splitlines())), Path("/proc/mounts").read_text()


def _names(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir())


def _digest(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


async def _work_copy(tmp_path: Path) -> Path:
    base = await ensure_base_image()
    work = tmp_path / "work.qcow2"
    await qemu.convert_to_qcow2(base.path, "qcow2", work)
    return work


@pytest.mark.timeout(1200)
async def test_openssh_server_and_the_readiness_unit_land_in_the_image(tmp_path: Path) -> None:
    work = await _work_copy(tmp_path)
    before = _attached()
    stamp = {"build_id": "b-chroot-1", "slug": "lab-slice", "built_at": "20261126T000000Z"}

    assert customise_chroot.pick_method() in ("nbd", "loop")
    await qemu.CUSTOMISERS["chroot"].customise(work, ["openssh-server"], stamp)

    assert _attached() == before
    assert _names(tmp_path) == ["work.qcow2"]
    raw = tmp_path / "image.raw"
    await qemu.convert_to_raw(work, "qcow2", raw)
    versions = await installed_versions(raw, ["openssh-server"], tmp_path)
    assert versions["openssh-server"].startswith("1:9.2")
    assert _attached() == before

    # The rest of what the customiser leaves, read from the image the same way the build reads it.
    part = customise_chroot.find_root(raw)
    mnt = tmp_path / "look"
    async with (
        customise_chroot.loop_device(raw, part, read_only=True) as dev,
        customise_chroot.mounted(dev, mnt, "-o", "ro,noload"),
    ):
        unit = (mnt / "etc/systemd/system/gpuaas-guest-ready.service").read_text()
        wants = mnt / "etc/systemd/system/multi-user.target.wants/gpuaas-guest-ready.service"
        assert wants.is_symlink() and str(wants.readlink()) == "/etc/systemd/system/gpuaas-guest-ready.service"
        written = json.loads((mnt / "etc/gpuaas-image-build.json").read_text())
        assert not (mnt / "usr/sbin/policy-rc.d").exists()
        assert not list((mnt / "var/cache/apt/archives").glob("*.deb"))
        assert not (mnt / "etc/resolv.conf.gpuaas-build").exists()
        assert (mnt / "lib/systemd/system/ssh.service").is_file()
    assert "WantedBy=multi-user.target" in unit and "cloud-init status --wait" in unit
    assert "/run/gpuaas-guest-ready" in unit
    assert written == {**stamp, "packages": ["openssh-server"]}
    assert _attached() == before


@pytest.mark.timeout(900)
async def test_a_package_not_in_the_archive_fails_the_build_and_leaves_nothing_attached(tmp_path: Path) -> None:
    work = await _work_copy(tmp_path)
    untouched = _digest(work)
    before = _attached()

    with pytest.raises(CustomiseError) as err:
        await qemu.CUSTOMISERS["chroot"].customise(work, ["gpuaas-no-such-package-x1"], {"build_id": "b-chroot-2"})

    assert str(err.value) == "package_not_in_archive: gpuaas-no-such-package-x1"
    assert _attached() == before
    # The build's copy is left as it was; the failed attempt's raw copy and mount point are gone.
    assert _digest(work) == untouched
    assert _names(tmp_path) == ["work.qcow2"]


async def test_a_package_name_that_is_an_option_is_refused_before_anything_is_opened(tmp_path: Path) -> None:
    before = _attached()
    with pytest.raises(CustomiseError, match=r"^invalid_package_name: --allow-unauthenticated$"):
        await qemu.CUSTOMISERS["chroot"].customise(tmp_path / "absent.qcow2", ["--allow-unauthenticated"], {})
    assert _attached() == before


@pytest.mark.timeout(600)
async def test_read_back_refuses_an_image_without_the_package(tmp_path: Path) -> None:
    base = await ensure_base_image()
    raw = tmp_path / "base.raw"
    await qemu.convert_to_raw(base.path, "qcow2", raw)
    before = _attached()

    with pytest.raises(CustomiseError) as err:
        await installed_versions(raw, ["udev", "openssh-server"], tmp_path)

    assert str(err.value) == "package_missing_after_build: openssh-server (absent)"
    assert _attached() == before
    assert _names(tmp_path) == ["base.raw"]
    root = customise_chroot.find_root(raw)
    assert (root.index, root.start) == (2, 65 << 20)


# --- the whole build: base fetched over loopback, customised in a chroot, verified, published ----------


@pytest_asyncio.fixture
async def pool(fresh_db: str) -> AsyncIterator[asyncpg.Pool]:
    conn = await asyncpg.connect(fresh_db)
    await apply_migrations(conn, "image_pipeline", "gpuaas_image_pipeline.migrations")
    await conn.close()
    p = await create_pool(fresh_db, "image_pipeline", min_size=1, max_size=5)
    yield p
    await p.close()


@pytest.fixture
def lab_site() -> Iterator[tuple[str, str]]:
    """The lab base image's cache entry served as a vendor publishes an image: the file and SHA256SUMS."""
    base = asyncio.run(ensure_base_image())
    url, stop = serve_directory(base.path.parent)
    yield url + base.path.name, url + "SHA256SUMS"
    stop()


@pytest.fixture
def registry(tmp_path: Path) -> Iterator[RegistryServer]:
    server = RegistryServer(tmp_path / "registry").start()
    yield server
    server.stop()


async def _tags(registry: RegistryServer, slug: str) -> list[str]:
    """Tags of every repository whose name ends with the slug (the namespace is the pipeline's setting)."""
    async with aiohttp.ClientSession(base_url=f"http://{registry.host}") as http:
        async with http.get("/v2/_catalog") as resp:
            repos = [r for r in (await resp.json())["repositories"] or [] if r.rsplit("/", 1)[-1] == slug]
        tags: list[str] = []
        for repo in repos:
            async with http.get(f"/v2/{repo}/tags/list") as resp:
                tags += (await resp.json()).get("tags") or []
    return sorted(tags)


async def _build(pool: asyncpg.Pool, runner: BuildRunner, slug: str, req: BuildRequest) -> asyncpg.Record:
    build = await runner.start(slug, req)
    # The build's own task: awaited, not polled.
    await runner.tasks[build["build_id"]]
    return await pool.fetchrow("SELECT * FROM builds WHERE build_id = $1", build["build_id"])


@pytest.mark.timeout(1500)
async def test_a_build_from_a_published_base_installs_verifies_and_publishes(
    pool: asyncpg.Pool, lab_site: tuple[str, str], registry: RegistryServer, tmp_path: Path
) -> None:
    base_url, sums_url = lab_site
    settings = ImagePipelineSettings(
        registry_host=registry.host,
        registry_tls_mode="plain-http",
        image_build_dir=str(tmp_path / "builds"),
        image_base_cache_dir=str(tmp_path / "bases"),
        image_cache_dir=str(tmp_path / "cache"),
        # The lab base is served from this machine over plain http with an unsigned list: the named exception.
        image_base_loopback_lab=True,
    )
    runner = build_runner(pool, None, settings)
    req = BuildRequest(
        base_url=base_url, checksums_url=sums_url, resize_gib=4, customise="chroot", packages=["openssh-server"]
    )
    before = _attached()

    planned = await runner.start("lab-slice", req.model_copy(update={"dry_run": True}))
    steps = "\n".join(planned["plan"]["steps"])
    assert f"fetch {base_url} unless" in steps and sums_url in steps and "resize" in steps
    assert "apt-get install -y --no-install-recommends openssh-server" in steps
    assert "read var/lib/dpkg/status back" in steps

    row = await _build(pool, runner, "lab-slice", req)
    assert row["status"] == "published", row["error"]
    assert row["source"] == base_url and row["virtual_size"] == 4 << 30
    image = await pool.fetchrow("SELECT * FROM os_images WHERE slug = 'lab-slice'")
    meta = json.loads(image["metadata"]) if isinstance(image["metadata"], str) else image["metadata"]
    assert meta["installed_packages"]["openssh-server"].startswith("1:9.2")
    assert image["digest_sha256"] == row["raw_sha256"] and image["status"] == "published"
    assert _attached() == before

    # A package the archive does not have fails the build with its reason; nothing stays attached, and
    # the base fetched for the first build is reused, not fetched again.
    bad = await _build(
        pool, runner, "lab-slice", req.model_copy(update={"packages": ["openssh-server", "gpuaas-no-such-package-x1"]})
    )
    assert bad["status"] == "failed"
    assert bad["error"] == "CustomiseError: package_not_in_archive: gpuaas-no-such-package-x1"
    assert _attached() == before
    assert len(_names(tmp_path / "bases")) == 1
    # Nothing half-written: the catalog row is the first build's, and the registry holds only its tag.
    after = await pool.fetchrow("SELECT * FROM os_images WHERE slug = 'lab-slice'")
    assert (after["digest_sha256"], after["source_uri"]) == (image["digest_sha256"], image["source_uri"])
    assert await _tags(registry, "lab-slice") == [row["artifact_ref"].split("@")[0].rsplit(":", 1)[1]]

    # A base whose checksum does not match its published list: refused before anything is built, and a slug the
    # catalog did not know stays unknown, with no repository in the registry.
    wrong = tmp_path / "wrong-site"
    wrong.mkdir()
    (wrong / "base.qcow2").symlink_to((await ensure_base_image()).path)
    (wrong / "SHA256SUMS").write_text(f"{'0' * 64}  base.qcow2\n")
    url, stop = serve_directory(wrong)
    try:
        refused = await _build(
            pool,
            runner,
            "lab-slice-unlisted",
            BuildRequest(base_url=url + "base.qcow2", checksums_url=url + "SHA256SUMS", customise="chroot"),
        )
    finally:
        stop()
    assert refused["status"] == "failed" and "sha256" in (refused["error"] or "").lower(), refused["error"]
    assert await pool.fetchrow("SELECT 1 FROM os_images WHERE slug = 'lab-slice-unlisted'") is None
    assert await _tags(registry, "lab-slice-unlisted") == []
    assert _attached() == before
