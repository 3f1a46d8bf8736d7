"""Small but real seed images for the dev stack and the tests.

The slice image is a raw disk made with `qemu-img` and a recognisable boot sector, so a clone onto a
slot's disk can be checked byte for byte; the host image is the root-filesystem tgz shape MAAS takes.
"""

from __future__ import annotations

import gzip
import io
import json
import subprocess
import tarfile
from pathlib import Path

from gpuaas_common.digests import sha256_file

SLICE_SLUG = "ubuntu-24.04-h200-slice"
HOST_SLUG = "ubuntu-24.04-h200-host"
IMAGE_CACHE_DIR = "/var/lib/gpuaas/slice-images"
SLICE_MARKER = b"GPUAAS-SEED-SLICE-IMAGE\x00"


def build_slice_image(path: Path, size_mib: int = 16) -> str:
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run(["qemu-img", "create", "-q", "-f", "raw", str(path), f"{size_mib}M"], check=True)
        with path.open("r+b") as f:
            f.write(SLICE_MARKER)
            f.seek(510)
            f.write(b"\x55\xaa")  # MBR boot signature: the clone carries a real partition-table marker
    return sha256_file(path)


def build_host_image(path: Path) -> str:
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        # A fixed gzip mtime keeps the digest reproducible across runs.
        with gzip.GzipFile(path, "wb", mtime=0) as gz, tarfile.open(fileobj=gz, mode="w") as tar:
            for name, data in (("curtin/", b""), ("etc/gpuaas/site-bootstrap.sh", b"#!/bin/sh\nexit 0\n")):
                info = tarfile.TarInfo(name.rstrip("/"))
                info.mtime = 0
                if name.endswith("/"):
                    info.type = tarfile.DIRTYPE
                    tar.addfile(info)
                else:
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
    return sha256_file(path)


def build_seed(images_dir: Path) -> Path:
    """Build both images into `images_dir` and write `seed.json` for the image pipeline."""
    slice_path = images_dir / f"{SLICE_SLUG}.raw"
    host_path = images_dir / f"{HOST_SLUG}.tgz"
    seeds = [
        {
            "slug": SLICE_SLUG,
            "kind": "slice",
            "sku": "h200-sxm-slice",
            "digest_sha256": build_slice_image(slice_path),
            "image_path": f"{IMAGE_CACHE_DIR}/{slice_path.name}",
            "source_uri": f"file://{slice_path.name}",
        },
        {
            "slug": HOST_SLUG,
            "kind": "host",
            "sku": "h200-sxm",
            "digest_sha256": build_host_image(host_path),
            "image_path": f"custom/{HOST_SLUG}",
            "source_uri": f"file://{host_path.name}",
        },
    ]
    seed_file = images_dir / "seed.json"
    seed_file.write_text(json.dumps(seeds, indent=2))
    return seed_file
