"""The image pipeline's tools run with a minimal environment: the service's database URL, admin token and
NATS credentials never reach qemu-img, qemu-io or the chroot customiser's host tools (nor a package script
they run)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gpuaas_image_pipeline.adapters import customise_chroot, qemu

SECRETS = {
    "GPUAAS_DATABASE_URL": "postgresql://gpuaas_image_pipeline:db-secret@127.0.0.1:5432/gpuaas",
    "GPUAAS_ADMIN_TOKEN": "admin-secret",
    "GPUAAS_NATS_CREDS": "/run/gpuaas/creds/image-pipeline.creds",
    "GPUAAS_ENROLMENT_SECRET": "enrolment-secret",
}

# Every fake tool writes its environment to a file of its own, then answers as much as the caller reads.
FAKE_TOOL = """#!/bin/sh
env > "{dumps}/$(basename "$0").$$"
for last; do :; done
case "$(basename "$0") $1" in
  "qemu-img info") echo '{{"format": "qcow2", "virtual-size": 1048576}}' ;;
  "qemu-img convert") : > "$last" ;;
  "losetup --find") echo /dev/loop7 ;;
esac
"""


@pytest.fixture
def fake_tools(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    bin_dir, dumps = tmp_path / "bin", tmp_path / "dumps"
    bin_dir.mkdir()
    dumps.mkdir()
    script = bin_dir / "qemu-img"
    script.write_text(FAKE_TOOL.format(dumps=dumps))
    script.chmod(0o755)
    for name in ("qemu-io", "losetup"):
        (bin_dir / name).symlink_to(script)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("LANG", "C.UTF-8")
    for name, value in SECRETS.items():
        monkeypatch.setenv(name, value)
    return dumps


def _environments(dumps: Path) -> dict[str, dict[str, str]]:
    found = {}
    for dump in dumps.iterdir():
        lines = dump.read_text().splitlines()
        found[dump.name.split(".")[0]] = dict(line.split("=", 1) for line in lines if "=" in line)
    return found


async def test_no_secret_reaches_an_image_tool(fake_tools: Path, tmp_path: Path) -> None:
    source = tmp_path / "base.img"
    source.write_bytes(b"\0" * 4096)
    assert (await qemu.image_info(source, "qcow2"))["format"] == "qcow2"
    await qemu.convert_to_qcow2(source, "raw", tmp_path / "work.qcow2")
    await qemu.StampCustomiser().customise(tmp_path / "work.qcow2", ["curl"], {"build_id": "b1"})
    async with customise_chroot.loop_device(source, customise_chroot.Partition(1, 0, 4096)) as dev:
        assert dev == "/dev/loop7"

    environments = _environments(fake_tools)
    assert set(environments) == {"qemu-img", "qemu-io", "losetup"}
    for tool, env in environments.items():
        leaked = {k for k, v in env.items() if k.startswith("GPUAAS_") or v in SECRETS.values()}
        assert leaked == set(), tool
        # What a tool needs still arrives.
        assert env["PATH"] == os.environ["PATH"] and env["LANG"] == "C.UTF-8", tool
