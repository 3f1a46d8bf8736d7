"""The pure parts of a MAAS host image's modes (build_and_upload, build_only, upload_only, dry_run): what each
request may carry, which built tgz upload_only sends, and the tree checks and size estimate that a build and a
dry run share."""

from __future__ import annotations

import gzip
import hashlib
import os
import socket
import tarfile
from pathlib import Path

import pytest
from pydantic import ValidationError

from gpuaas_image_pipeline.adapters import host_image
from gpuaas_image_pipeline.adapters.host_image import (
    SITE_BOOTSTRAP,
    HostTreeError,
    build_rootfs_tgz,
    check_out_dir,
    plan_rootfs,
    verify_built_tgz,
)
from gpuaas_image_pipeline.domain.catalog import (
    HOST_BUILDS_KEPT,
    HostUploadRequest,
    mark_host_build_uploading,
    pick_host_build,
    record_host_build,
)

A, B, C = "a" * 64, "b" * 64, "c" * 64


def entry(sha: str, **kw: object) -> dict[str, object]:
    return {"sha256": sha, "size": 1, "source_path": f"/x/{sha[:4]}", "status": "built", "operation_id": None, **kw}


# --- the request per mode ------------------------------------------------------------------------


def test_the_default_is_todays_build_and_upload() -> None:
    req = HostUploadRequest(rootfs="/srv/tree")
    assert (req.mode, req.builds, req.uploads) == ("build_and_upload", True, True)
    assert (
        HostUploadRequest(mode="build_only", rootfs="/t").uploads,
        HostUploadRequest(mode="dry_run", rootfs="/t").builds,
    ) == (False, False)
    assert HostUploadRequest(mode="upload_only").uploads and not HostUploadRequest(mode="upload_only").builds


@pytest.mark.parametrize(
    "body, says",
    [
        ({"mode": "build_only"}, "rootfs is required"),
        ({"mode": "dry_run"}, "rootfs is required"),
        ({}, "rootfs is required"),
        ({"mode": "upload_only", "rootfs": "/t"}, "reads no tree"),
        ({"mode": "upload_only", "site_bootstrap": "/b.sh"}, "reads no tree"),
        ({"mode": "build_only", "rootfs": "/t", "sha256": A}, "upload_only only"),
        ({"mode": "upload_only", "sha256": "A" * 64}, "pattern"),
        ({"mode": "rebuild", "rootfs": "/t"}, "mode"),
    ],
)
def test_a_request_that_does_not_fit_its_mode_is_refused(body: dict, says: str) -> None:
    with pytest.raises(ValidationError) as exc:
        HostUploadRequest.model_validate(body)
    assert says in str(exc.value)


# --- the built tgz files an image remembers -------------------------------------------------------


def test_builds_are_kept_newest_first_and_bounded() -> None:
    builds: list[dict] = []
    for i in range(HOST_BUILDS_KEPT + 3):
        builds = record_host_build(builds, entry(f"{i:064x}"))
    assert len(builds) == HOST_BUILDS_KEPT
    assert builds[0]["sha256"] == f"{HOST_BUILDS_KEPT + 2:064x}"
    assert builds[-1]["sha256"] == f"{3:064x}"


def test_the_same_content_built_again_moves_first_and_keeps_its_upload() -> None:
    builds = record_host_build([], entry(A))
    builds = mark_host_build_uploading(builds, A, "op-1")
    builds = record_host_build(builds, entry(B))
    builds = record_host_build(builds, entry(A, built_at="later"))
    assert [b["sha256"] for b in builds] == [A, B]
    assert (builds[0]["status"], builds[0]["operation_id"], builds[0]["built_at"]) == (
        "upload_requested",
        "op-1",
        "later",
    )
    assert builds[1]["status"] == "built"


def test_upload_only_sends_the_named_build_else_the_newest() -> None:
    builds = [entry(A), entry(B)]
    assert pick_host_build(builds, None)["sha256"] == A  # type: ignore[index]
    assert pick_host_build(builds, B)["sha256"] == B  # type: ignore[index]
    assert pick_host_build(builds, C) is None
    assert pick_host_build([], None) is None


# --- the tree checks a build and a dry run share ---------------------------------------------------


def make_tree(root: Path) -> Path:
    (root / "etc").mkdir(parents=True)
    (root / "etc" / "os-release").write_text('NAME="Ubuntu"\n')
    (root / "usr" / "lib").mkdir(parents=True)
    (root / "usr" / "lib" / "blob").write_bytes(b"x" * 5000)
    (root / "etc" / "link").symlink_to("../usr/lib/blob")
    deep = root / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    (deep / "f").write_text("long name")
    return root


def test_the_plan_counts_what_the_build_archives_and_estimates_its_size(tmp_path: Path) -> None:
    tree = make_tree(tmp_path / "root")
    bootstrap = tmp_path / "bootstrap.sh"
    bootstrap.write_text("#!/bin/sh\necho hi\n")
    plan = plan_rootfs(tree, tmp_path / "out", bootstrap)
    built = build_rootfs_tgz(tree, tmp_path / "out" / "x.tgz", bootstrap)
    with tarfile.open(built.path) as tar:
        members = tar.getmembers()
    assert plan.entries == len(members) == 11
    assert plan.files == sum(m.isfile() for m in members) == 4
    assert plan.file_bytes == sum(m.size for m in members if m.isfile())
    assert (plan.adds_curtin_marker, plan.adds_site_bootstrap) == (True, True)
    assert plan.tar_bytes == len(gzip.decompress(built.path.read_bytes()))
    # A tree that carries both itself adds neither.
    (tree / "curtin").mkdir()
    (tree / SITE_BOOTSTRAP).parent.mkdir(parents=True)
    (tree / SITE_BOOTSTRAP).write_text("#!/bin/sh\n")
    again = plan_rootfs(tree, tmp_path / "out", bootstrap)
    assert (again.adds_curtin_marker, again.adds_site_bootstrap) == (False, False)


def test_a_socket_is_skipped_by_both(tmp_path: Path) -> None:
    tree = make_tree(tmp_path / "root")
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(tree / "run.sock"))
        plan = plan_rootfs(tree, tmp_path / "out")
        built = build_rootfs_tgz(tree, tmp_path / "out" / "x.tgz")
    with tarfile.open(built.path) as tar:
        names = tar.getnames()
    assert plan.skipped == ["run.sock"] and "run.sock" not in names
    assert plan.entries == len(names)


def _gone(tree: Path) -> Path:
    return tree / "nope"


def _no_os_release(tree: Path) -> Path:
    (tree / "etc" / "os-release").unlink()
    return tree


def _curtin_file(tree: Path) -> Path:
    (tree / "curtin").write_text("a file")
    return tree


def _curtin_link(tree: Path) -> Path:
    (tree / "curtin").symlink_to("usr")
    return tree


@pytest.mark.parametrize(
    "spoil, code",
    [
        (_gone, "rootfs_missing"),
        (_no_os_release, "rootfs_not_an_os_tree"),
        (_curtin_file, "curtin_marker_not_a_directory"),
        (_curtin_link, "curtin_marker_not_a_directory"),
    ],
)
def test_a_tree_the_build_would_refuse(tmp_path: Path, spoil, code: str) -> None:
    tree = spoil(make_tree(tmp_path / "root"))
    with pytest.raises(HostTreeError) as exc:
        plan_rootfs(tree, tmp_path / "out")
    assert exc.value.code == code


def test_the_output_directory_inside_the_tree_is_refused(tmp_path: Path) -> None:
    tree = make_tree(tmp_path / "root")
    for out in (tree, tree / "var" / "images"):
        with pytest.raises(HostTreeError) as exc:
            plan_rootfs(tree, out)
        assert exc.value.code == "rootfs_holds_output"


def test_a_missing_bootstrap_is_refused(tmp_path: Path) -> None:
    with pytest.raises(HostTreeError) as exc:
        plan_rootfs(make_tree(tmp_path / "root"), tmp_path / "out", tmp_path / "no.sh")
    assert exc.value.code == "site_bootstrap_missing"


def test_entries_this_process_cannot_read_are_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tree = make_tree(tmp_path / "root")
    hidden = {str(tree / "usr" / "lib" / "blob"), str(tree / "etc")}
    real = os.access
    # Root reads everything: the permission check is stood in for.
    monkeypatch.setattr(host_image.os, "access", lambda p, mode: str(p) not in hidden and real(p, mode))
    with pytest.raises(HostTreeError) as exc:
        plan_rootfs(tree, tmp_path / "out")
    assert exc.value.code == "rootfs_unreadable"
    assert "2 entries" in exc.value.message and "etc/" in exc.value.message and "usr/lib/blob" in exc.value.message


def test_an_output_directory_that_cannot_be_written_is_refused(tmp_path: Path, monkeypatch) -> None:
    assert check_out_dir(tmp_path / "not" / "yet") > 0  # created by the build
    (tmp_path / "file").write_text("")
    with pytest.raises(HostTreeError) as exc:
        check_out_dir(tmp_path / "file" / "below")
    assert exc.value.code == "host_image_dir_unwritable"


def test_a_failed_build_leaves_no_partial_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tree = make_tree(tmp_path / "root")

    def broken(self, *a, **kw):
        raise OSError("disk full")

    monkeypatch.setattr(host_image.tarfile.TarFile, "add", broken)
    with pytest.raises(OSError):
        build_rootfs_tgz(tree, tmp_path / "out" / "x.tgz")
    assert list((tmp_path / "out").iterdir()) == []


# --- a built tgz before it is sent again ------------------------------------------------------------


def test_a_built_tgz_is_checked_before_upload_only_sends_it(tmp_path: Path) -> None:
    path = tmp_path / "img.tar.gz"
    path.write_bytes(b"built bytes")
    sha, size = hashlib.sha256(b"built bytes").hexdigest(), len(b"built bytes")
    assert verify_built_tgz(path, sha, size) is None
    path.write_bytes(b"built bytez")  # same size, other bytes
    assert verify_built_tgz(path, sha, size) == "built_tgz_changed"
    path.write_bytes(b"more built bytes")
    assert verify_built_tgz(path, sha, size) == "built_tgz_changed"
    path.unlink()
    assert verify_built_tgz(path, sha, size) == "built_tgz_missing"
