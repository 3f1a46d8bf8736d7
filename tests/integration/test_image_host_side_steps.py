"""The customiser's host-side file steps resolve every path inside the image root (issue 38, N5d): an image
whose var/cache/apt/archives, etc/systemd, etc/machine-id or etc point at the build host by absolute links
leaves the host's files as they were; the steps land inside the image, where the image's own links lead
when resolved from its root."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from gpuaas_image_pipeline.adapters import customise_chroot
from gpuaas_image_pipeline.adapters.paths import PathRefused, in_root


def _snapshot(d: Path) -> dict[str, str]:
    """Every entry under d with its content's digest (or its link target): what the host must keep."""
    out = {}
    for p in sorted(d.rglob("*")):
        rel = str(p.relative_to(d))
        if p.is_symlink():
            out[rel] = "-> " + str(p.readlink())
        elif p.is_file():
            out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
        else:
            out[rel] = "dir"
    return out


@pytest.fixture
def hostile(tmp_path: Path) -> tuple[Path, Path]:
    """(image root, host directory): the root's links name the host directory by its absolute path."""
    host = tmp_path / "host"
    (host / "archives").mkdir(parents=True)
    (host / "archives" / "important.deb").write_bytes(b"host package cache")
    (host / "systemd" / "system").mkdir(parents=True)
    (host / "systemd" / "system" / "sshd.service").write_text("[Service]\n")
    (host / "machine-id").write_text("0123456789abcdef0123456789abcdef\n")
    (host / "ssh").mkdir()
    (host / "ssh" / "ssh_host_ed25519_key").write_text("host key")
    root = tmp_path / "root"
    for d in ("var/cache/apt", "var/lib/apt/lists", "etc", "usr/sbin", "usr/bin"):
        (root / d).mkdir(parents=True)
    (root / "var/cache/apt/archives").symlink_to(host / "archives")
    (root / "etc/systemd").symlink_to(host / "systemd")
    (root / "etc/machine-id").symlink_to(host / "machine-id")
    (root / "etc/ssh").symlink_to(host / "ssh")
    (root / "usr/bin/cloud-init").write_text("#!/bin/sh\n")
    return root, host


async def test_an_image_linking_into_the_host_leaves_the_host_untouched(hostile: tuple[Path, Path]) -> None:
    root, host = hostile
    before = _snapshot(host)

    async with customise_chroot.no_service_starts(root), customise_chroot.host_resolver(root):
        assert (root / "etc/resolv.conf").is_file()
    await customise_chroot.asyncio.to_thread(customise_chroot.write_readiness_unit, root)
    customise_chroot._clean(root)

    assert _snapshot(host) == before
    # The unit went where the image's own link leads from its root: <root>/<host path>/system.
    inside = in_root(root, "etc/systemd/system")
    assert inside == root / str(host / "systemd" / "system").lstrip("/")
    assert (inside / customise_chroot.READY_UNIT).read_text() == customise_chroot.READY_UNIT_TEXT
    wants = inside / "multi-user.target.wants" / customise_chroot.READY_UNIT
    assert wants.is_symlink() and str(wants.readlink()) == f"/etc/systemd/system/{customise_chroot.READY_UNIT}"
    assert not (root / "etc/resolv.conf").exists() and not (root / "usr/sbin/policy-rc.d").exists()


def test_in_root_resolves_as_the_image_would(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "usr/lib").mkdir(parents=True)
    (root / "lib").symlink_to("usr/lib")
    (root / "usr/lib/up").symlink_to("../../../../../../etc")
    (root / "loop").symlink_to("loop")
    assert in_root(root, "/lib/x") == root / "usr/lib/x"
    assert in_root(root, "lib/up/passwd") == root / "etc/passwd"  # .. stops at the image's root
    assert in_root(root, "lib", follow_last=False) == root / "lib"
    with pytest.raises(PathRefused, match=r"^image_link_loop: "):
        in_root(root, "loop/x")
