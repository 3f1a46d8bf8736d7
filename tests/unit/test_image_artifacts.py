"""The artifact formats shared by the pipeline and the node agent, exercised on real files."""

from __future__ import annotations

import hashlib
import os
import tarfile
from pathlib import Path

import pytest

from gpuaas_dev.testing.servers import RegistryServer
from gpuaas_image_pipeline.adapters import host_image, registry, sparse
from gpuaas_image_pipeline.domain.catalog import ArtifactRef, activation_ready, node_schedulable
from gpuaas_node_agent.adapters import image_cache

D = "d" * 64


def test_gate_rules() -> None:
    assert not activation_ready(D, set(), {})
    assert activation_ready(D, {"a", "b"}, {"a": ("verified", D), "b": ("verified", D)})
    assert not activation_ready(D, {"a", "b"}, {"a": ("verified", D), "b": ("mismatch", "e" * 64)})
    assert not activation_ready(D, {"a", "b"}, {"a": ("verified", D)})
    assert not node_schedulable(D, ("verified", "e" * 64))
    ref = ArtifactRef.parse("oci://reg.example:5000/slice-guest-images/x:20250101T000000Z@sha256:" + "1" * 64)
    assert ref.repository == "slice-guest-images/x" and ref.uri.endswith("@sha256:" + "1" * 64)


@pytest.fixture(scope="module")
def registry_server(tmp_path_factory: pytest.TempPathFactory):
    server = RegistryServer(tmp_path_factory.mktemp("registry")).start()
    yield server
    server.stop()


def _sparse_raw(path: Path) -> bytes:
    data = os.urandom(3 << 20)
    with path.open("wb") as f:
        f.truncate(256 << 20)
        f.seek(7 << 20)
        f.write(data)
        f.seek(200 << 20)
        f.write(b"tail")
    return data


def test_pack_push_pull_round_trip_keeps_holes(tmp_path: Path, registry_server: RegistryServer) -> None:
    raw = tmp_path / "img.raw"
    _sparse_raw(raw)
    packed = sparse.pack(raw, tmp_path / "img.gpsparse")
    assert packed.raw_sha256 == hashlib.sha256(raw.read_bytes()).hexdigest()
    assert packed.blob_size < 4 << 20  # holes did not travel
    pushed = registry.push_artifact(
        push_host=registry_server.host,
        repository="slice-guest-images/img",
        tag="t1",
        tls_mode="plain-http",
        blob=tmp_path / "img.gpsparse",
        blob_digest=packed.blob_sha256,
        blob_size=packed.blob_size,
        media_type=sparse.MEDIA_TYPE,
        title="img.raw",
        config={},
        annotations={},
        chunk_size=1 << 20,
    )
    ref = ArtifactRef(registry_server.host, "slice-guest-images/img", "t1", pushed.manifest_digest).uri
    dest = tmp_path / "node" / "img.raw"
    out = image_cache.pull_into_cache(
        artifact_ref=ref,
        blob_digest=f"sha256:{packed.blob_sha256}",
        blob_size=packed.blob_size,
        expected_raw_sha256=packed.raw_sha256,
        dest=dest,
        tls_mode="plain-http",
    )
    assert out.status == "verified" and dest.read_bytes() == raw.read_bytes()
    assert os.stat(dest).st_blocks * 512 < 8 << 20  # sparse on the node too

    # The catalog says another digest: refused, and the verified file is left alone.
    out = image_cache.pull_into_cache(
        artifact_ref=ref,
        blob_digest=f"sha256:{packed.blob_sha256}",
        blob_size=packed.blob_size,
        expected_raw_sha256=D,
        dest=dest,
        tls_mode="plain-http",
    )
    assert out.status == "mismatch" and dest.read_bytes() == raw.read_bytes()
    assert [p.name for p in dest.parent.iterdir()] == ["img.raw"]  # no temp file left behind

    with pytest.raises(image_cache.PullError):
        image_cache.pull_into_cache(
            artifact_ref=ref,
            blob_digest="sha256:" + "9" * 64,
            blob_size=1,
            expected_raw_sha256=packed.raw_sha256,
            dest=dest,
            tls_mode="plain-http",
        )


def test_host_image_tgz_has_curtin_marker_and_site_bootstrap(tmp_path: Path) -> None:
    root = tmp_path / "rootfs"
    (root / "etc").mkdir(parents=True)
    (root / "etc" / "hostname").write_text("h200\n")
    bootstrap = tmp_path / "bootstrap.sh"
    bootstrap.write_text("#!/bin/sh\nexit 0\n")
    first = host_image.build_rootfs_tgz(root, tmp_path / "out" / "host.tar.gz", bootstrap)
    with tarfile.open(first.path) as tar:
        members = {m.name: m for m in tar.getmembers()}
    assert members["curtin"].isdir()
    assert members[host_image.SITE_BOOTSTRAP].mode == 0o755
    assert "etc/hostname" in members
    again = host_image.build_rootfs_tgz(root, tmp_path / "out" / "host2.tar.gz", bootstrap)
    assert (again.sha256, again.size) == (first.sha256, first.size)
    assert first.sha256 == hashlib.sha256(first.path.read_bytes()).hexdigest()
