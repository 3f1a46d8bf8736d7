"""Clone, wipe and wipe proof with the real tools (qemu-img, mkfs.ext4, wipefs, blkid) on file stand-ins."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from gpuaas_node_agent.adapters import disk

MIB = 1 << 20
PATTERN = b"GPUAAS-IMAGE-PATTERN-" * 100


def _run(*argv: str | Path) -> None:
    subprocess.run([str(a) for a in argv], check=True, capture_output=True)


@pytest.fixture
def qcow2_image(tmp_path: Path) -> Path:
    """A 4 MiB qcow2 whose first bytes and a block at 2 MiB carry a recognisable pattern."""
    raw = tmp_path / "pattern.raw"
    with raw.open("wb") as f:
        f.truncate(4 * MIB)
        f.write(PATTERN)
        f.seek(2 * MIB)
        f.write(PATTERN[::-1])
    image = tmp_path / "base.qcow2"
    _run("qemu-img", "create", "-q", "-f", "qcow2", image, str(4 * MIB))
    _run("qemu-img", "convert", "-n", "-f", "raw", "-O", "qcow2", raw, image)
    return image


def _stand_in(tmp_path: Path, name: str, size: int, fill: bytes = b"\xaa") -> Path:
    path = tmp_path / name
    path.write_bytes(fill * size)
    return path


async def test_clone_qcow2_onto_preexisting_target(tmp_path: Path, qcow2_image: Path) -> None:
    target = _stand_in(tmp_path, "nvme0.img", 8 * MIB)
    await disk.clone_image(qcow2_image, "qcow2", target)
    data = target.read_bytes()
    assert len(data) == 8 * MIB  # -n: the target keeps its size
    assert data[: len(PATTERN)] == PATTERN
    assert data[2 * MIB : 2 * MIB + len(PATTERN)] == PATTERN[::-1]
    assert data[len(PATTERN) : 2 * MIB] == bytes(2 * MIB - len(PATTERN))  # image zeros land as zeros


async def test_clone_onto_too_small_target_is_a_clear_error(tmp_path: Path, qcow2_image: Path) -> None:
    target = _stand_in(tmp_path, "small.img", 1 * MIB)
    with pytest.raises(disk.DiskError) as info:
        await disk.clone_image(qcow2_image, "qcow2", target)
    assert info.value.code == "target_too_small"
    assert info.value.rc == 1
    assert "smaller than input" in info.value.stderr


async def test_clone_refuses_missing_target_and_source(tmp_path: Path, qcow2_image: Path) -> None:
    with pytest.raises(disk.DiskError) as info:
        await disk.clone_image(qcow2_image, "qcow2", tmp_path / "absent.img")
    assert info.value.code == "disk_missing"
    assert not (tmp_path / "absent.img").exists()
    target = _stand_in(tmp_path, "t.img", MIB)
    with pytest.raises(disk.DiskError) as info:
        await disk.clone_image(tmp_path / "nope.qcow2", "qcow2", target)
    assert info.value.code == "source_missing"


async def test_clone_with_wrong_format_fails(tmp_path: Path, qcow2_image: Path) -> None:
    raw = _stand_in(tmp_path, "plain.raw", MIB)
    target = _stand_in(tmp_path, "t.img", 8 * MIB)
    with pytest.raises(disk.DiskError) as info:
        await disk.clone_image(raw, "qcow2", target)
    assert info.value.code == "source_format_mismatch"
    assert info.value.rc not in (None, 0)


async def test_filesystem_is_seen_then_wiped_and_verified(tmp_path: Path) -> None:
    target = _stand_in(tmp_path, "nvme1.img", 16 * MIB, fill=b"\x5a")
    _run("mkfs.ext4", "-F", "-q", target)

    before = await disk.verify_wiped(target)
    assert before.verified is False
    assert "ext4" in {s.type for s in before.signatures}
    assert {s.source for s in before.signatures} == {"wipefs", "blkid"}
    assert before.detail and "ext4" in before.detail

    method = await disk.wipe(target)
    assert method == "zero_fill"
    assert target.stat().st_size == 16 * MIB
    assert target.read_bytes() == bytes(16 * MIB)

    after = await disk.verify_wiped(target, method)
    assert after.verified is True
    assert after.signatures == []
    assert after.method == "zero_fill" and after.device == str(target)
    assert after.checked_at.tzinfo is not None


async def test_known_magic_without_mkfs(tmp_path: Path) -> None:
    """An MBR boot signature plus a partition entry: blkid/wipefs both recognise a `dos` partition table."""
    target = _stand_in(tmp_path, "nvme2.img", 4 * MIB, fill=b"\x00")
    with target.open("r+b") as f:
        f.seek(446)
        f.write(bytes([0x00, 0, 2, 0, 0x83, 0, 0, 0]) + (2048).to_bytes(4, "little") + (4096).to_bytes(4, "little"))
        f.seek(510)
        f.write(b"\x55\xaa")
    before = await disk.verify_wiped(target)
    assert before.verified is False and "dos" in {s.type for s in before.signatures}
    proof = await disk.wipe_and_verify(target)
    assert proof.verified is True and proof.method == "zero_fill"
    assert (await disk.verify_wiped(target)).verified is True


async def test_unverifiable_wipe_is_not_verified(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = _stand_in(tmp_path, "nvme3.img", MIB, fill=b"\x00")
    # No wipefs/blkid on PATH: the check cannot run, so there is no proof.
    empty_bin = tmp_path / "empty-bin"
    empty_bin.mkdir()
    monkeypatch.setenv("PATH", str(empty_bin))
    proof = await disk.verify_wiped(target, "zero_fill")
    assert proof.verified is False
    assert proof.detail is not None and "wipefs is not installed" in proof.detail and "blkid" in proof.detail


async def test_missing_device_is_not_verified(tmp_path: Path) -> None:
    proof = await disk.verify_wiped(tmp_path / "gone.img")
    assert proof.verified is False
    assert proof.detail and "does not exist" in proof.detail
    failed = await disk.wipe_and_verify(tmp_path / "gone.img")
    assert failed.verified is False and failed.method == "failed"
