"""The sparse raw artifact format shared by its writer (image pipeline) and its reader (node agent).

Format `application/vnd.gpuaas.sparse-raw.v1` (all integers big-endian u64):

    magic b"GPSPRS01" | virtual_size
    repeated: offset | length | <length bytes of data>     (offsets strictly increasing, within size)
    end:      virtual_size | 0 | sha256(raw image) (32 bytes)

Holes never travel: the writer walks SEEK_DATA/SEEK_HOLE and the reader rebuilds holes with
ftruncate. The raw sha256 (the catalog digest) hashes holes as zeros on both sides.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable

MEDIA_TYPE = "application/vnd.gpuaas.sparse-raw.v1"
MAGIC = b"GPSPRS01"
U64X2 = struct.Struct(">QQ")
CHUNK = 4 << 20
_ZEROS = memoryview(bytes(CHUNK))

Progress = Callable[[int, int], None]


def hash_zeros(h: "hashlib._Hash", n: int) -> None:
    """Feed `n` zero bytes (a hole) to a hash without allocating them."""
    while n > 0:
        step = min(n, CHUNK)
        h.update(_ZEROS[:step])
        n -= step
