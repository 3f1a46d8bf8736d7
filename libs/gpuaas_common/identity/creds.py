"""`.creds` files: a user JWT and its seed in the layout every NATS client reads.

Files are created 0600 from the first byte (never written and then chmod-ed), because a seed is the
identity itself.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from .jwt import JwtError, decode

_BLOCK = re.compile(r"-----BEGIN ([A-Z ]+)-----\s*\n\s*(\S+)\s*\n\s*------END \1------")


@dataclass(frozen=True)
class Creds:
    jwt: str
    seed: bytes

    def render(self) -> str:
        return (
            "-----BEGIN NATS USER JWT-----\n"
            f"{self.jwt}\n"
            "------END NATS USER JWT------\n\n"
            "************************* IMPORTANT *************************\n"
            "NKEY Seed printed below can be used to sign and prove identity.\n"
            "NKEYs are sensitive and should be treated as secrets.\n\n"
            "-----BEGIN USER NKEY SEED-----\n"
            f"{self.seed.decode()}\n"
            "------END USER NKEY SEED------\n\n"
            "*************************************************************\n"
        )

    @property
    def claims(self) -> dict:
        return decode(self.jwt, verify=False)

    @property
    def name(self) -> str:
        return str(self.claims.get("name", ""))

    def __repr__(self) -> str:  # the seed never goes to a log
        return f"Creds(name={self.name!r})"


def parse(text: str) -> Creds:
    blocks = dict(_BLOCK.findall(text))
    jwt, seed = blocks.get("NATS USER JWT"), blocks.get("USER NKEY SEED")
    if not jwt or not seed:
        raise JwtError("not a NATS creds file: needs a user JWT and a user seed block")
    decode(jwt, verify=False)
    return Creds(jwt=jwt, seed=seed.encode())


def read(path: Path | str) -> Creds:
    return parse(Path(path).read_text())


def write_secret(path: Path | str, text: str, *, owner: tuple[int, int] | None = None) -> Path:
    """Write a secret file readable by its owner only, replacing it atomically. `owner` (uid, gid): whose it is
    from before it takes the path's name, when a root issuer writes another user's file (a renewal), so the
    reader never meets it unreadable."""
    path = Path(path)
    if path.is_symlink():
        # A file handed out to its reader's own volume (`hand_out`): written where it lives, so the reader, who
        # mounts only that volume, sees the new file. Only root makes links in a creds directory (0711, root's).
        path = path.resolve()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        if owner is not None:
            os.fchown(f.fileno(), *owner)
        f.write(text)
    tmp.replace(path)
    return path


def write(path: Path | str, creds: Creds, *, owner: tuple[int, int] | None = None) -> Path:
    return write_secret(path, creds.render(), owner=owner)


def hand_out(path: Path | str, to_dir: Path | str, *, owner: tuple[int, int] | None = None) -> Path:
    """Move a creds file into its reader's own directory (a volume only that reader mounts) and leave a link in its
    place, so the issuer keeps writing it by its usual name (`write_secret` follows the link). Idempotent: a file
    handed out already is only given to `owner` again; one written over the link since (an issuer that replaced
    it) is moved again."""
    path, dest = Path(path), Path(to_dir) / Path(path).name
    if path.is_symlink():
        if owner is not None:
            os.chown(dest, *owner)
        return dest
    write_secret(dest, path.read_text(), owner=owner)
    path.unlink()
    path.symlink_to(dest)
    return dest
