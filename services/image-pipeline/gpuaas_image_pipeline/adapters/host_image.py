"""MAAS host image: a root-filesystem tgz that MAAS deploys as boot resource `custom/<name>`.

The tgz (not a dd* disk image) lets MAAS own partitioning and the ESP. curtin recognises the root
filesystem by the `/curtin/` marker directory, so the archive always carries it; the site bootstrap is
copied to the path the runbook's first-boot step runs it from. Upload goes through the MAAS gateway.
"""

from __future__ import annotations

import gzip
import os
import shutil
import stat
import tarfile
from dataclasses import dataclass, field
from pathlib import Path

from gpuaas_common.digests import sha256_file

SITE_BOOTSTRAP = "usr/local/share/gpuaas/site-bootstrap/h200-slice-vm/bootstrap.sh"
CURTIN_MARKER = "curtin"
# Every OS root MAAS deploys names itself here (often a link into usr/lib): a tree without it is not one.
OS_RELEASE = "etc/os-release"
TAR_BLOCK = 512
# A few names each refusal lists, not thousands.
LISTED = 5


class HostTreeError(ValueError):
    """A tree (or request) the build would refuse, with the reason code the API answers."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(frozen=True)
class TreePlan:
    """What archiving a tree would write, found by the same walk and checks as the build itself."""

    rootfs: Path
    entries: int  # tree entries archived (files, directories, links, devices)
    files: int  # regular files among them
    file_bytes: int  # their content
    tar_bytes: int  # the uncompressed archive's size (headers, content, padding): the tgz is at most about this
    adds_curtin_marker: bool
    adds_site_bootstrap: bool
    skipped: list[str] = field(default_factory=list)  # sockets: tar keeps none

    def as_dict(self) -> dict[str, object]:
        return {
            "rootfs": str(self.rootfs),
            "entries": self.entries,
            "files": self.files,
            "file_bytes": self.file_bytes,
            "tar_bytes_estimate": self.tar_bytes,
            "adds_curtin_marker": self.adds_curtin_marker,
            "adds_site_bootstrap": self.adds_site_bootstrap,
            "skipped": self.skipped,
        }


@dataclass(frozen=True)
class HostImage:
    path: Path
    sha256: str
    size: int


def _walk(rootfs: Path) -> list[Path]:
    """The tree's entries in archive order (the one walk the plan and the build share)."""
    return sorted(rootfs.rglob("*"))


def _padded(size: int) -> int:
    return -(-size // TAR_BLOCK) * TAR_BLOCK


def _header(name: str, from_tree: bool = True) -> int:
    """An entry's header, and for an entry read from disk the PAX header before it (its sub-second mtime, and
    the name when ustar cannot hold it): about its size, the PAX record may also carry a long link target."""
    if not from_tree:
        return TAR_BLOCK
    record = 30 + (len(name) + 12 if len(name) > 100 else 0)
    return 2 * TAR_BLOCK + _padded(record)


def _check_root(rootfs: Path, out_dir: Path, site_bootstrap: Path | None) -> None:
    if not rootfs.is_dir():
        raise HostTreeError("rootfs_missing", f"root tree {rootfs} is not a directory")
    if site_bootstrap is not None and not site_bootstrap.is_file():
        raise HostTreeError("site_bootstrap_missing", f"{site_bootstrap} is not a file")
    root = rootfs.resolve()
    out = out_dir.resolve()
    if out == root or out.is_relative_to(root):
        raise HostTreeError("rootfs_holds_output", f"the host image directory {out_dir} is inside the tree {rootfs}")
    if not os.path.lexists(rootfs / OS_RELEASE):
        raise HostTreeError("rootfs_not_an_os_tree", f"{rootfs} has no {OS_RELEASE}: not a root filesystem")
    marker = rootfs / CURTIN_MARKER
    if os.path.lexists(marker) and (marker.is_symlink() or not marker.is_dir()):
        raise HostTreeError(
            "curtin_marker_not_a_directory", f"{marker} exists but is not a directory: curtin would not find the root"
        )


def plan_rootfs(rootfs: Path, out_dir: Path, site_bootstrap: Path | None = None) -> TreePlan:
    """Check a root tree as the build does, without writing anything, and say what archiving it would give.
    Raises HostTreeError for a tree the build refuses: not a directory, a missing bootstrap, the output
    directory inside the tree (the archive would hold itself), no etc/os-release, a curtin entry that is not
    a directory (curtin finds the root by that directory), entries this process cannot read."""
    _check_root(rootfs, out_dir, site_bootstrap)
    entries = files = file_bytes = 0
    tar_bytes = 2 * TAR_BLOCK  # the end-of-archive blocks
    unreadable: list[str] = []
    skipped: list[str] = []
    names: set[str] = set()
    for path in _walk(rootfs):
        rel = path.relative_to(rootfs).as_posix()
        st = path.lstat()
        if stat.S_ISSOCK(st.st_mode):
            skipped.append(rel)
            continue
        names.add(rel)
        entries += 1
        tar_bytes += _header(rel)
        if stat.S_ISREG(st.st_mode):
            files += 1
            file_bytes += st.st_size
            tar_bytes += _padded(st.st_size)
            if not os.access(path, os.R_OK):
                unreadable.append(rel)
        elif stat.S_ISDIR(st.st_mode) and not os.access(path, os.R_OK | os.X_OK):
            unreadable.append(rel + "/")
    if unreadable:
        more = len(unreadable) - LISTED
        shown = ", ".join(unreadable[:LISTED]) + (f" and {more} more" if more > 0 else "")
        raise HostTreeError("rootfs_unreadable", f"{len(unreadable)} entries of {rootfs} cannot be read here: {shown}")
    adds_marker = CURTIN_MARKER not in names
    adds_bootstrap = site_bootstrap is not None and SITE_BOOTSTRAP not in names
    if adds_marker:
        entries += 1
        tar_bytes += _header(CURTIN_MARKER, from_tree=False)
    if adds_bootstrap:
        assert site_bootstrap is not None
        entries += 1
        files += 1
        size = site_bootstrap.stat().st_size
        file_bytes += size
        tar_bytes += _header(SITE_BOOTSTRAP) + _padded(size)
    # tarfile pads the archive to whole records.
    tar_bytes = -(-tar_bytes // tarfile.RECORDSIZE) * tarfile.RECORDSIZE
    return TreePlan(rootfs, entries, files, file_bytes, tar_bytes, adds_marker, adds_bootstrap, skipped[:LISTED])


def check_out_dir(out_dir: Path) -> int:
    """The free bytes where the tgz would be written; HostTreeError when this process could not write there
    (the nearest existing directory up the path decides: the build creates the rest)."""
    probe = out_dir
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir() or not os.access(probe, os.W_OK | os.X_OK):
        raise HostTreeError("host_image_dir_unwritable", f"the host image directory {out_dir} cannot be written here")
    return shutil.disk_usage(probe).free


def build_rootfs_tgz(rootfs: Path, out: Path, site_bootstrap: Path | None = None) -> HostImage:
    """Archive `rootfs` as the image root, adding the curtin marker and the site bootstrap. Entries are
    sorted and timestamps kept from the tree, with a fixed gzip mtime, so a rebuild of the same tree is
    byte-identical (same sha256, no re-upload). A failure leaves no partial file behind."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".part")

    def norm(info: tarfile.TarInfo) -> tarfile.TarInfo:
        info.uid = info.gid = 0
        info.uname = info.gname = "root"
        return info

    try:
        # Level 6, gzip's own default: on 180 MB of the lab host image's tree level 9 took 3.9 times as long
        # (26.7 s against 6.8 s) for an archive 0.6 % smaller. No file name in the gzip header either: the same
        # tree must give the same bytes under any name.
        with (
            tmp.open("wb") as raw,
            gzip.GzipFile(filename="", fileobj=raw, mode="wb", mtime=0, compresslevel=6) as gz,
            tarfile.open(fileobj=gz, mode="w", format=tarfile.PAX_FORMAT) as tar,
        ):
            names = set()
            for path in _walk(rootfs):
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
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return HostImage(out, sha256_file(out), out.stat().st_size)


def verify_built_tgz(path: Path, sha256: str, size: int) -> str | None:
    """Why a built tgz can no longer be sent as recorded (its file gone, or other bytes now), or None."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return "built_tgz_missing"
    if not stat.S_ISREG(st.st_mode) or st.st_size != size:
        return "built_tgz_changed"
    try:
        digest = sha256_file(path)
    except FileNotFoundError:
        return "built_tgz_missing"
    except OSError:
        return "built_tgz_unreadable"
    return None if digest == sha256 else "built_tgz_changed"
