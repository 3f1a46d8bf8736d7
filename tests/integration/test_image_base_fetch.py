"""The base image a build starts from comes from a URL and is trusted only once it matches the published
checksum list; the cache holds nothing that did not."""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuaas_dev.lab.base_image import serve_directory
from gpuaas_image_pipeline.adapters.base_image import BaseImageError, FetchPolicy, fetch_base_image, resize

# The loopback site below is the lab's exception (plain http, unsigned list), as its setting allows.
LAB = FetchPolicy(loopback_lab=True)


async def _qemu_img(*argv: str) -> bytes:
    proc = await asyncio.create_subprocess_exec("qemu-img", *argv, stdout=asyncio.subprocess.PIPE)
    out, _ = await proc.communicate()
    assert proc.returncode == 0, argv
    return out


@pytest.fixture
def published(tmp_path: Path) -> Iterator[tuple[Path, str]]:
    """A directory served over loopback, as a vendor's image directory is: the images and SHA256SUMS."""
    site = tmp_path / "site"
    site.mkdir()
    url, stop = serve_directory(site)
    yield site, url
    stop()


def _publish(site: Path, name: str, sums_digest: str | None = None) -> str:
    digest = hashlib.sha256((site / name).read_bytes()).hexdigest()
    (site / "SHA256SUMS").write_text(f"{'0' * 64}  other.img\n{sums_digest or digest} *{name}\n")
    return digest


async def test_a_listed_image_is_cached_by_digest_and_reused(published: tuple[Path, str], tmp_path: Path) -> None:
    site, url = published
    await _qemu_img("create", "-q", "-f", "qcow2", str(site / "base.qcow2"), "64M")
    digest = _publish(site, "base.qcow2")
    cache = tmp_path / "cache"
    seen: list[tuple[int, int]] = []

    first = await fetch_base_image(
        url + "base.qcow2", url + "SHA256SUMS", cache, policy=LAB, progress=lambda d, t: seen.append((d, t))
    )
    assert first.downloaded and first.sha256 == digest and first.name == "base.qcow2"
    assert hashlib.sha256(first.path.read_bytes()).hexdigest() == digest
    assert first.path.parent == cache and digest in first.path.name
    assert seen and seen[-1][0] == first.path.stat().st_size

    # Gone from the site: a second fetch must come from the cache alone.
    (site / "base.qcow2").unlink()
    again = await fetch_base_image(url + "base.qcow2", url + "SHA256SUMS", cache, policy=LAB)
    assert not again.downloaded and again.path == first.path
    assert sorted(p.name for p in cache.iterdir()) == [first.path.name]


async def test_a_damaged_cache_entry_is_fetched_again(published: tuple[Path, str], tmp_path: Path) -> None:
    site, url = published
    await _qemu_img("create", "-q", "-f", "qcow2", str(site / "base.qcow2"), "64M")
    digest = _publish(site, "base.qcow2")
    cache = tmp_path / "cache"
    first = await fetch_base_image(url + "base.qcow2", url + "SHA256SUMS", cache, policy=LAB)
    with first.path.open("r+b") as f:
        f.write(b"rot")

    again = await fetch_base_image(url + "base.qcow2", url + "SHA256SUMS", cache, policy=LAB)
    assert again.downloaded and hashlib.sha256(again.path.read_bytes()).hexdigest() == digest


async def test_a_digest_that_differs_from_the_list_is_refused_and_nothing_is_cached(
    published: tuple[Path, str], tmp_path: Path
) -> None:
    site, url = published
    (site / "base.qcow2").write_bytes(b"not what the vendor published" * 1000)
    _publish(site, "base.qcow2", sums_digest="ab" * 32)
    cache = tmp_path / "cache"

    with pytest.raises(BaseImageError) as err:
        await fetch_base_image(url + "base.qcow2", url + "SHA256SUMS", cache, policy=LAB)
    assert str(err.value).startswith("base_checksum_mismatch: base.qcow2 ")
    assert "\n" not in str(err.value)
    assert list(cache.iterdir()) == []


async def test_a_name_absent_from_the_list_and_a_failed_download_are_refused(
    published: tuple[Path, str], tmp_path: Path
) -> None:
    site, url = published
    (site / "base.qcow2").write_bytes(b"x" * 4096)
    _publish(site, "base.qcow2")
    cache = tmp_path / "cache"

    with pytest.raises(BaseImageError, match=r"^base_not_in_checksums: noble\.img is not listed in "):
        await fetch_base_image(url + "noble.img", url + "SHA256SUMS", cache, policy=LAB)
    (site / "SHA256SUMS").write_text((site / "SHA256SUMS").read_text() + f"{'1' * 64}  gone.img\n")
    with pytest.raises(BaseImageError, match=r"^base_download_failed: .*gone\.img answered HTTP 404$"):
        await fetch_base_image(url + "gone.img", url + "SHA256SUMS", cache, policy=LAB)
    with pytest.raises(BaseImageError, match=r"^base_download_failed: .*SHA256SUMS.missing answered HTTP 404$"):
        await fetch_base_image(url + "base.qcow2", url + "SHA256SUMS.missing", cache, policy=LAB)
    assert not cache.exists() or list(cache.iterdir()) == []


async def test_resize_grows_the_virtual_disk(tmp_path: Path) -> None:
    image = tmp_path / "work.qcow2"
    await _qemu_img("create", "-q", "-f", "qcow2", str(image), "64M")
    await resize(image, "qcow2", 2)
    info = json.loads(await _qemu_img("info", "--output=json", str(image)))
    assert info["virtual-size"] == 2 << 30
