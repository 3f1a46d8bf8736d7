"""Image publish and prewarm benchmark: a sparse raw image (default 4 GiB virtual, 512 MiB data) packed,
pushed to a real registry (Debian's docker-registry on loopback) and pulled into a node cache with
verification, against a same-run baseline of reading its data once.

    .venv/bin/python bench/images.py --json [--virtual-gib 4] [--data-mib 512]

The baseline reads the image's data extents once (SEEK_DATA/SEEK_HOLE, page cache warm, no hashing):
the least any transfer of this image has to do. Target: publish <= 2x baseline. Compare ratios, not
absolute times. Logs go to stderr, the JSON result to stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from gpuaas_dev.testing.servers import RegistryServer
from gpuaas_image_pipeline.adapters import registry, sparse
from gpuaas_image_pipeline.domain.catalog import ArtifactRef
from gpuaas_node_agent.adapters import image_cache

EXTENT = 64 << 20


def make_image(path: Path, virtual: int, data: int) -> None:
    """Data in 64 MiB extents spread evenly over the disk, holes in between, like a freshly built OS image."""
    n = max(1, data // EXTENT)
    stride = virtual // n
    block = os.urandom(1 << 20)
    with path.open("wb") as f:
        f.truncate(virtual)
        for i in range(n):
            f.seek(i * stride)
            for _ in range(EXTENT >> 20):
                f.write(block[:8] + os.urandom(8) + block[16:])


def read_data_once(path: Path) -> int:
    total = 0
    buf = bytearray(4 << 20)
    view = memoryview(buf)
    with path.open("rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        for offset, length in sparse.data_extents(f.fileno(), size):
            f.seek(offset)
            left = length
            while left:
                k = f.readinto(view[: min(left, len(buf))])
                total += k
                left -= k
    return total


def read_whole_file(path: Path) -> int:
    """What a transfer that is not sparse-aware reads: every byte of the virtual size, holes as zeros."""
    total = 0
    buf = bytearray(4 << 20)
    with path.open("rb", buffering=0) as f:
        while k := f.readinto(buf):
            total += k
    return total


def timed(fn, *a, **kw):
    t = time.perf_counter()
    out = fn(*a, **kw)
    return out, time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--virtual-gib", type=float, default=4.0)
    ap.add_argument("--data-mib", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="gpuaas-bench-images-") as tmp_s:
        tmp = Path(tmp_s)
        reg = RegistryServer(tmp / "registry").start()
        try:
            raw = tmp / "image.raw"
            print(f"making {args.virtual_gib} GiB image with {args.data_mib} MiB data", file=sys.stderr)
            make_image(raw, int(args.virtual_gib * (1 << 30)), args.data_mib << 20)
            read_data_once(raw)  # warm the page cache so every measurement starts from the same place
            baselines = [timed(read_data_once, raw)[1] for _ in range(args.rounds)]
            whole = min(timed(read_whole_file, raw)[1] for _ in range(args.rounds))
            packed, pack_s = timed(sparse.pack, raw, tmp / "image.gpsparse")
            publishes, pulls = [], []
            for i in range(args.rounds):
                # A fresh repository and tag per round: nothing is skipped as already present.
                repo = f"slice-guest-images/bench-{i}"
                pushed, s = timed(
                    registry.push_artifact,
                    push_host=reg.host,
                    repository=repo,
                    tag="bench",
                    tls_mode="plain-http",
                    blob=tmp / "image.gpsparse",
                    blob_digest=packed.blob_sha256,
                    blob_size=packed.blob_size,
                    media_type=sparse.MEDIA_TYPE,
                    title="image.raw",
                    config={},
                    annotations={},
                )
                assert pushed.uploaded or i == 0, "the blob was already in the registry"
                publishes.append(s)
                dest = tmp / "node" / f"image-{i}.raw"
                out, s = timed(
                    image_cache.pull_into_cache,
                    artifact_ref=ArtifactRef(reg.host, repo, "bench").uri,
                    blob_digest=f"sha256:{packed.blob_sha256}",
                    blob_size=packed.blob_size,
                    expected_raw_sha256=packed.raw_sha256,
                    dest=dest,
                    tls_mode="plain-http",
                )
                assert out.status == "verified", out
                pulls.append(s)
                dest.unlink()
            baseline = min(baselines)
            publish = min(publishes)
            result = {
                "virtual_bytes": packed.virtual_size,
                "data_bytes": packed.data_bytes,
                "blob_bytes": packed.blob_size,
                "baseline_read_data_s": round(baseline, 4),
                "baseline_read_whole_file_s": round(whole, 4),
                "pack_and_hash_s": round(pack_s, 4),
                "publish_s": round(publish, 4),
                "publish_runs_s": [round(x, 4) for x in publishes],
                "prewarm_pull_verify_s": round(min(pulls), 4),
                "prewarm_runs_s": [round(x, 4) for x in pulls],
                "publish_over_baseline": round(publish / baseline, 2),
                "prewarm_over_baseline": round(min(pulls) / baseline, 2),
                "target_publish_over_baseline": 2.0,
                "publish_within_target": publish / baseline <= 2.0,
                "publish_over_whole_file_read": round(publish / whole, 2),
                "publish_mb_s": round(packed.blob_size / publish / 1e6, 1),
                "prewarm_mb_s": round(packed.blob_size / min(pulls) / 1e6, 1),
            }
        finally:
            reg.stop()
    print(json.dumps(result, indent=2 if not args.json else None))


if __name__ == "__main__":
    main()
