"""The one file digest helper: streamed, and the same answer as hashing the whole content at once."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from gpuaas_common.digests import sha256_file


def test_sha256_of_a_file_larger_than_any_read_buffer(tmp_path: Path) -> None:
    data = os.urandom(3 << 20) + b"tail"
    path = tmp_path / "image.raw"
    path.write_bytes(data)
    assert sha256_file(path) == hashlib.sha256(data).hexdigest()
    assert sha256_file(str(path)) == hashlib.sha256(data).hexdigest()


def test_sha256_of_an_empty_file(tmp_path: Path) -> None:
    (tmp_path / "empty").write_bytes(b"")
    assert sha256_file(tmp_path / "empty") == hashlib.sha256(b"").hexdigest()
