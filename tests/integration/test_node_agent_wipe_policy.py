"""Each site wipe policy's method on a file stand-in, with the real wipefs/blkid and a read-back of sampled
blocks; and for each, a wipe that did not do its job (the violating fixture) yields an unverified proof."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from gpuaas_node_agent.adapters import disk

MIB = 1 << 20


def _tenant_disk(tmp_path: Path, name: str = "nvme0.img", size: int = 8 * MIB) -> Path:
    """A disk a tenant used: an ext4 file system with data spread over it (non-zero in every block)."""
    path = tmp_path / name
    path.write_bytes(bytes(range(1, 256)) * (size // 255) + b"\x01" * (size % 255))
    subprocess.run(["mkfs.ext4", "-q", "-F", "-E", "nodiscard", str(path)], check=True, capture_output=True)
    return path


@pytest.mark.parametrize(
    ("policy", "method", "effect"),
    [
        (None, "zero_fill", "read back as zeros"),
        ("blkdiscard", "blkdiscard", "read back as zeros"),
        ("nvme_format", "nvme_format", "no longer hold their data"),  # contents indeterminate after a format
        ("crypto_erase", "crypto_erase", "no longer hold their data"),
    ],
)
async def test_each_policy_wipes_by_its_method_and_proves_it(tmp_path: Path, policy, method, effect) -> None:
    target = _tenant_disk(tmp_path)
    assert (await disk.verify_wiped(target)).verified is False  # ext4 is there before
    size = target.stat().st_size
    proof = await disk.wipe_and_verify(target, policy)
    assert proof.method == method, proof
    assert proof.verified is True, proof.detail
    assert proof.verification is not None and effect in proof.verification and "simulated" in proof.verification
    assert target.stat().st_size == size  # the stand-in keeps its size, as a namespace would
    data = target.read_bytes()
    if method == "crypto_erase":
        # Noise, not zeros: nothing of the tenant's blocks remains, and no signature either.
        assert data.count(0) < len(data) // 100
    else:
        assert data.count(0) == len(data)


def _do_nothing(path: Path, policy) -> str:
    # The violating fixture: the tool "succeeded" and named its method, but the data is untouched.
    return {"blkdiscard": "blkdiscard", "nvme_format": "nvme_format", "crypto_erase": "crypto_erase"}[policy]


def _signatures_only(path: Path, policy) -> str:
    # Subtler: only the signatures are erased (like `wipefs --all`), the tenant's data stays.
    subprocess.run(["wipefs", "--all", "--force", str(path)], check=True, capture_output=True)
    return _do_nothing(path, policy)


@pytest.mark.parametrize("policy", ["blkdiscard", "nvme_format", "crypto_erase"])
@pytest.mark.parametrize("fake", [_do_nothing, _signatures_only])
async def test_a_wipe_that_left_data_is_not_verified(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, policy, fake
) -> None:
    target = _tenant_disk(tmp_path)
    monkeypatch.setattr(disk, "_erase_file", fake)
    proof = await disk.wipe_and_verify(target, policy)
    assert proof.method == policy
    assert proof.verified is False
    assert proof.detail is not None and "sampled blocks fail" in proof.detail
    assert proof.verification is not None and "NO" in proof.verification


async def test_a_crypto_erase_that_zeroed_only_half_the_disk_is_caught(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = _tenant_disk(tmp_path)

    def half(path: Path, policy) -> str:
        size = path.stat().st_size
        with path.open("r+b") as f:
            f.write(b"\x00" * (size // 2))
        return "crypto_erase"

    monkeypatch.setattr(disk, "_erase_file", half)
    proof = await disk.wipe_and_verify(target, "crypto_erase")
    # The first half (ext4's superblock included) is gone, the sampled blocks of the second half are not.
    assert proof.verified is False and "still holds its data" in (proof.detail or "")


def test_readback_rules_per_method() -> None:
    data, zero, noise = b"\x07" * 4096, bytes(4096), b"\x5a" * 4096
    offsets = [0, 4096]
    for method in ("blkdiscard", "blkdiscard+zeroout", "zeroout", "zero_fill"):
        assert disk.readback_problems(method, [data, zero], [zero, zero], offsets) == []
        assert disk.readback_problems(method, [data, zero], [noise, zero], offsets) == [
            f"block at 0 is not zero after {method}"
        ]
    for method in ("nvme_format", "crypto_erase"):
        # Contents after a format or crypto erase are indeterminate: changed or zero both pass.
        assert disk.readback_problems(method, [data, data], [zero, noise], offsets) == []
        assert disk.readback_problems(method, [data, zero], [data, zero], offsets) == [
            f"block at 0 still holds its data after {method}"
        ]


def test_sample_offsets_cover_both_ends_and_are_block_aligned() -> None:
    size = 64 * MIB
    offsets = disk.sample_offsets(size)
    assert offsets[0] == 0 and offsets[-1] == size - 4096
    assert all(o % 4096 == 0 and 0 <= o < size for o in offsets)
    assert len(offsets) >= 32
    assert disk.sample_offsets(100) == [0]  # a disk smaller than a block is read whole


async def test_an_unknown_policy_is_refused_before_the_disk_is_touched(tmp_path: Path) -> None:
    target = _tenant_disk(tmp_path)
    before = target.read_bytes()
    proof = await disk.wipe_and_verify(target, "shred")  # type: ignore[arg-type]
    assert proof.verified is False and proof.method == "failed" and "wipe_policy_unknown" in (proof.detail or "")
    assert target.read_bytes() == before
