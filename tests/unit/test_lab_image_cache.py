"""The lab's image cache keeps the current recipe's images and drops older ones after a build."""

from __future__ import annotations

from pathlib import Path

from gpuaas_dev.lab.slice_image import prune_stale


def test_older_recipes_go_and_the_current_and_in_flight_ones_stay(tmp_path: Path) -> None:
    current_base, old_base = "a" * 24, "b" * 24
    for d in (current_base, old_base, ".c-in-flight", "slice/k-now", "slice/k-old", "slice/.k-writing", "fetched"):
        (tmp_path / d).mkdir(parents=True)
    (tmp_path / "fetched" / ("sha256-" + "1" * 64 + ".qcow2")).write_bytes(b"now")
    (tmp_path / "fetched" / ("sha256-" + "2" * 64 + ".qcow2")).write_bytes(b"old")
    (tmp_path / "fetched" / ("sha256-" + "2" * 64 + ".x.part")).write_bytes(b"downloading")

    gone = prune_stale(tmp_path, base_entry=current_base, base_sha256="1" * 64, slice_key="k-now")

    assert sorted(p.relative_to(tmp_path).as_posix() for p in gone) == sorted(
        [old_base, "slice/k-old", "fetched/sha256-" + "2" * 64 + ".qcow2"]
    )
    left = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*"))
    assert current_base in left and ".c-in-flight" in left and "slice/k-now" in left and "slice/.k-writing" in left
    assert "fetched/sha256-" + "1" * 64 + ".qcow2" in left and "fetched/sha256-" + "2" * 64 + ".x.part" in left
