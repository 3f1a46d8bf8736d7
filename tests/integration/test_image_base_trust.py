"""A base image is trusted only through a signed checksum list or a digest pinned in the request (issue 38,
N5b): the list's detached signature (SHA256SUMS.gpg, as Ubuntu's cloud images publish it) is checked with
gpgv against the configured keyring, and URLs are https but for the lab's loopback base, by its setting.

The vendor's key is made here with gpg --batch in a private GNUPGHOME; the site is served over loopback."""

from __future__ import annotations

import hashlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuaas_dev.lab.base_image import serve_directory
from gpuaas_image_pipeline.adapters.base_image import BaseImageError, FetchPolicy, fetch_base_image
from gpuaas_image_pipeline.domain.catalog import BuildRequest

IMAGE = b"a vendor's cloud image" * 4096


def _gpg(home: Path, *argv: str) -> None:
    env = {**os.environ, "GNUPGHOME": str(home)}
    subprocess.run(
        ["gpg", "--batch", "--quiet", "--pinentry-mode", "loopback", "--passphrase", "", *argv],
        env=env,
        check=True,
        capture_output=True,
    )


def _make_key(home: Path, uid: str) -> Path:
    """A signing key of its own in `home`; returns its public keyring (the file gpgv --keyring reads)."""
    home.mkdir(mode=0o700)
    _gpg(home, "--quick-gen-key", uid, "ed25519", "sign", "never")
    keyring = home / "keyring.gpg"
    _gpg(home, "--output", str(keyring), "--export")
    return keyring


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    """name -> (GNUPGHOME, public keyring): the vendor's key and somebody else's."""
    base = tmp_path_factory.mktemp("gpg")
    return {
        name: (base / name, _make_key(base / name, f"{name} <{name}@example.invalid>"))
        for name in ("vendor", "mallory")
    }


@pytest.fixture
def site(tmp_path: Path) -> Iterator[tuple[Path, str]]:
    d = tmp_path / "site"
    d.mkdir()
    (d / "noble.img").write_bytes(IMAGE)
    (d / "SHA256SUMS").write_text(f"{hashlib.sha256(IMAGE).hexdigest()} *noble.img\n")
    url, stop = serve_directory(d)
    yield d, url
    stop()


def _sign(site_dir: Path, home: Path) -> None:
    _gpg(
        home,
        "--yes",
        "--armor",
        "--detach-sign",
        "--output",
        str(site_dir / "SHA256SUMS.gpg"),
        str(site_dir / "SHA256SUMS"),
    )


def _policy(keyring: Path) -> FetchPolicy:
    # loopback_lab only lets the test's loopback site be plain http: with a keyring the list is still checked.
    return FetchPolicy(keyring=keyring, loopback_lab=True)


async def test_a_list_signed_by_the_keyrings_key_is_trusted(
    site: tuple[Path, str], keys: dict[str, tuple[Path, Path]], tmp_path: Path
) -> None:
    d, url = site
    home, keyring = keys["vendor"]
    _sign(d, home)
    got = await fetch_base_image(url + "noble.img", url + "SHA256SUMS", tmp_path / "cache", policy=_policy(keyring))
    assert got.sha256 == hashlib.sha256(IMAGE).hexdigest() and got.path.read_bytes() == IMAGE


@pytest.mark.parametrize("forgery", ["other-key", "list-changed", "no-signature"])
async def test_a_list_without_a_good_signature_is_refused_and_nothing_is_cached(
    site: tuple[Path, str], keys: dict[str, tuple[Path, Path]], tmp_path: Path, forgery: str
) -> None:
    d, url = site
    _home, keyring = keys["vendor"]
    if forgery == "other-key":
        _sign(d, keys["mallory"][0])
    elif forgery == "list-changed":
        _sign(d, keys["vendor"][0])
        # Someone on the path hands over another image and its digest, the vendor's signature left as it was.
        (d / "noble.img").write_bytes(b"backdoored" * 4096)
        (d / "SHA256SUMS").write_text(f"{hashlib.sha256(b'backdoored' * 4096).hexdigest()} *noble.img\n")
    cache = tmp_path / "cache"

    with pytest.raises(BaseImageError) as err:
        await fetch_base_image(url + "noble.img", url + "SHA256SUMS", cache, policy=_policy(keyring))

    expected = "base_unsigned: " if forgery == "no-signature" else "base_signature_bad: "
    assert str(err.value).startswith(expected), str(err.value)
    assert "\n" not in str(err.value)
    assert not cache.exists() or list(cache.iterdir()) == []


async def test_a_pinned_digest_is_trusted_alone_and_a_mismatch_refused(site: tuple[Path, str], tmp_path: Path) -> None:
    d, url = site
    strict = FetchPolicy(loopback_lab=True)  # no keyring: only the pin can vouch for a list
    good = hashlib.sha256(IMAGE).hexdigest()
    got = await fetch_base_image(url + "noble.img", None, tmp_path / "ok", pinned_sha256=good, policy=strict)
    assert got.sha256 == good

    with pytest.raises(
        BaseImageError,
        match=r"^base_checksum_mismatch: noble\.img from .* has sha256 [0-9a-f]{64}, the pinned sha256 says 0{64}$",
    ):
        await fetch_base_image(url + "noble.img", None, tmp_path / "bad", pinned_sha256="0" * 64, policy=strict)
    assert list((tmp_path / "bad").iterdir()) == []
    # A list that disagrees with the pin is refused before the image is fetched.
    with pytest.raises(
        BaseImageError,
        match=r"^base_checksum_mismatch: .*SHA256SUMS lists noble\.img as [0-9a-f]{64}, the request pins 1{64}$",
    ):
        await fetch_base_image(
            url + "noble.img", url + "SHA256SUMS", tmp_path / "c", pinned_sha256="1" * 64, policy=strict
        )
    assert not (tmp_path / "c").exists()


async def test_plain_http_and_an_unsigned_list_are_refused_without_the_lab_setting(
    site: tuple[Path, str], tmp_path: Path
) -> None:
    _d, url = site
    with pytest.raises(
        BaseImageError,
        match=r"^base_url_refused: http://127\.0\.0\.1:\d+/noble\.img is plain http: only the lab's loopback",
    ):
        await fetch_base_image(url + "noble.img", url + "SHA256SUMS", tmp_path / "cache")
    # https, but nothing to check its list against: refused before any connection is made.
    with pytest.raises(BaseImageError, match=r"^base_unsigned: no keyring is configured"):
        await fetch_base_image(
            "https://cloud-images.example.invalid/noble.img",
            "https://cloud-images.example.invalid/SHA256SUMS",
            tmp_path / "cache",
        )
    assert not (tmp_path / "cache").exists()


def test_a_build_request_names_https_or_the_lab_loopback() -> None:
    req = BuildRequest(
        base_url="http://mirror.example.invalid/noble.img", checksums_url="http://mirror.example.invalid/SHA256SUMS"
    )
    with pytest.raises(ValueError, match=r"^http://mirror\.example\.invalid/noble\.img is not an https URL$"):
        req.check(loopback_http=True)
    lab = BuildRequest(base_url="http://127.0.0.1:8000/noble.img", checksums_url="http://127.0.0.1:8000/SHA256SUMS")
    lab.check(loopback_http=True)
    with pytest.raises(ValueError, match=r"is plain http: only the lab's loopback base may be"):
        lab.check()
    with pytest.raises(ValueError, match=r"^base_url needs checksums_url"):
        BuildRequest(base_url="https://cloud-images.example.invalid/noble.img").check()
    BuildRequest(base_url="https://cloud-images.example.invalid/noble.img", base_sha256="a" * 64).check()
