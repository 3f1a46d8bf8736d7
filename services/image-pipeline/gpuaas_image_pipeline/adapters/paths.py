"""Paths the pipeline resolves for a request or inside an image, so that neither reaches past where it may.

- `confined`: a path an admin request names (a build's source, a host image's rootfs or site bootstrap) must
  lie, once every link in it is followed, inside one of the configured directories (issue 38, N15).
- `in_root`: a path inside an image's root filesystem, resolved as the image itself would resolve it (an
  absolute link means the image's root, `..` stops at it), so a host-side step never follows the image's
  links into the build host (N5d). Python's stdlib has no openat2(RESOLVE_IN_ROOT): this walks the path one
  component at a time, as the kernel would for a process chrooted there.
"""

from __future__ import annotations

import os
from pathlib import Path, PurePosixPath

# A link chain longer than this is refused, as the kernel's ELOOP does (MAXSYMLINKS is 40).
MAX_LINKS = 40


class PathRefused(ValueError):
    """One line starting with its reason code."""


def dirs_setting(value: str) -> list[Path]:
    """A comma-separated directory list setting."""
    return [Path(d.strip()) for d in value.split(",") if d.strip()]


def confined(path: str, dirs: list[Path], *, what: str, code: str) -> Path:
    """`path` with every link resolved, if that lies inside one of `dirs` (resolved too); else PathRefused."""
    if not os.path.isabs(path):
        raise PathRefused(f"{code}: {what} {path} is not an absolute path")
    real = Path(os.path.realpath(path))
    for d in dirs:
        base = Path(os.path.realpath(d))
        if real == base or real.is_relative_to(base):
            return real
    allowed = ", ".join(str(d) for d in dirs) or "(none configured)"
    raise PathRefused(f"{code}: {what} {path} is outside the directories allowed for it ({allowed})")


def in_root(root: Path, path: str | PurePosixPath, *, follow_last: bool = True) -> Path:
    """The host path of `path` (absolute or relative, as the image sees it) inside `root`: every link on the
    way is read and followed within the root, never out of it. follow_last=False leaves the last component
    unresolved (to replace or remove a link itself). Missing components are fine (a file to create)."""
    parts = list(PurePosixPath("/", path).parts[1:])
    done: list[str] = []
    links = 0
    while parts:
        name = parts.pop(0)
        if name in ("", "."):
            continue
        if name == "..":
            if done:
                done.pop()
            continue
        here = root.joinpath(*done, name)
        if (parts or follow_last) and here.is_symlink():
            links += 1
            if links > MAX_LINKS:
                raise PathRefused(f"image_link_loop: {path} passes more than {MAX_LINKS} links in the image")
            target = PurePosixPath(os.readlink(here))
            if target.is_absolute():
                done = []
            parts = [*(target.parts[1:] if target.is_absolute() else target.parts), *parts]
            continue
        done.append(name)
    return root.joinpath(*done)
