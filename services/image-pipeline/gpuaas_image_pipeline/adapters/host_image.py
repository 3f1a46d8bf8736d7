"""MAAS host image: a root-filesystem tgz that MAAS deploys as boot resource `custom/<name>`.

The tgz (not a dd* disk image) lets MAAS own partitioning and the ESP. curtin recognises the root
filesystem by the `/curtin/` marker directory, so the archive always carries it; the site bootstrap is
copied to the path the runbook's first-boot step runs it from. Upload goes through the MAAS gateway.
"""

from __future__ import annotations

import gzip
import tarfile
from dataclasses import dataclass
from pathlib import Path

from gpuaas_common.digests import sha256_file

SITE_BOOTSTRAP = "usr/local/share/gpuaas/site-bootstrap/h200-slice-vm/bootstrap.sh"
CURTIN_MARKER = "curtin"


@dataclass(frozen=True)
class HostImage:
    path: Path
    sha256: str
    size: int


def build_rootfs_tgz(rootfs: Path, out: Path, site_bootstrap: Path | None = None) -> HostImage:
    """Archive `rootfs` as the image root, adding the curtin marker and the site bootstrap. Entries are
    sorted and timestamps kept from the tree, with a fixed gzip mtime, so a rebuild of the same tree is
    byte-identical (same sha256, no re-upload)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".part")

    def norm(info: tarfile.TarInfo) -> tarfile.TarInfo:
        info.uid = info.gid = 0
        info.uname = info.gname = "root"
        return info

    # No file name in the gzip header either: the same tree must give the same bytes under any name.
    with (
        tmp.open("wb") as raw,
        gzip.GzipFile(filename="", fileobj=raw, mode="wb", mtime=0) as gz,
        tarfile.open(fileobj=gz, mode="w", format=tarfile.PAX_FORMAT) as tar,
    ):
        names = set()
        for path in sorted(rootfs.rglob("*")):
            rel = path.relative_to(rootfs).as_posix()
            names.add(rel)
            tar.add(path, arcname=rel, recursive=False, filter=norm)
        if CURTIN_MARKER not in names:
            info = norm(tarfile.TarInfo(CURTIN_MARKER))
            info.type, info.mode = tarfile.DIRTYPE, 0o755
            tar.addfile(info)
        if site_bootstrap is not None and SITE_BOOTSTRAP not in names:
            info = norm(tar.gettarinfo(str(site_bootstrap), arcname=SITE_BOOTSTRAP))
            info.mode = 0o755
            with site_bootstrap.open("rb") as f:
                tar.addfile(info, f)
    tmp.replace(out)
    return HostImage(out, sha256_file(out), out.stat().st_size)
