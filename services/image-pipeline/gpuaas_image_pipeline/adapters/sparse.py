"""The artifact that travels: a sparse raw image packed so that holes never travel as zeros.

Format `application/vnd.gpuaas.sparse-raw.v1` (all integers big-endian u64):

    magic b"GPSPRS01" | virtual_size
    repeated: offset | length | <length bytes of data>     (offsets strictly increasing, within size)
    end:      virtual_size | 0 | sha256(raw image) (32 bytes)

Why not gzip/zstd: compressing 4 GiB of which 3.5 GiB are holes still reads and compresses the holes,
and the data of an OS image is mostly incompressible. Data extents come from SEEK_DATA/SEEK_HOLE, so
the cost is proportional to the data, and a node rebuilds the holes with ftruncate. The raw sha256
(the catalog digest) is computed in the same pass, hashing holes as zeros, and the blob sha256 (the
OCI layer digest) while writing, so a build reads its data exactly once.
"""

from __future__ import annotations

import hashlib
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from gpuaas_common.sparse_format import CHUNK, MAGIC, MEDIA_TYPE, Progress, hash_zeros
from gpuaas_common.sparse_format import U64X2 as _U64X2

__all__ = ["CHUNK", "MAGIC", "MEDIA_TYPE", "Progress"]


@dataclass(frozen=True)
class PackResult:
    raw_sha256: str
    blob_sha256: str
    blob_size: int
    virtual_size: int
    data_bytes: int


def data_extents(fd: int, size: int) -> Iterator[tuple[int, int]]:
    """(offset, length) of the allocated ranges of a file; the whole file where holes are not reported."""
    pos = 0
    while pos < size:
        try:
            start = os.lseek(fd, pos, os.SEEK_DATA)
        except OSError:  # ENXIO: only a hole is left
            return
        end = os.lseek(fd, start, os.SEEK_HOLE)
        yield start, min(end, size) - start
        pos = end


def pack(raw: Path, out: Path, progress: Progress | None = None) -> PackResult:
    size = raw.stat().st_size
    raw_h, blob_h = hashlib.sha256(), hashlib.sha256()
    written = data = 0
    tmp = out.with_name(out.name + ".part")
    with raw.open("rb", buffering=0) as src, tmp.open("wb") as dst:
        extents = list(data_extents(src.fileno(), size))
        total = sum(length for _, length in extents) or 1

        def emit(b: bytes | memoryview) -> None:
            nonlocal written
            blob_h.update(b)
            dst.write(b)
            written += len(b)

        emit(MAGIC + struct.pack(">Q", size))
        pos = 0
        buf = bytearray(CHUNK)
        view = memoryview(buf)
        for offset, length in extents:
            hash_zeros(raw_h, offset - pos)
            emit(_U64X2.pack(offset, length))
            left = length
            src.seek(offset)
            while left:
                n = src.readinto(view[: min(left, CHUNK)])
                if not n:
                    raise IOError(f"{raw} shrank while packing")
                raw_h.update(view[:n])
                emit(view[:n])
                left -= n
                data += n
                if progress:
                    progress(data, total)
            pos = offset + length
        hash_zeros(raw_h, size - pos)
        emit(_U64X2.pack(size, 0) + raw_h.digest())
        dst.flush()
        os.fsync(dst.fileno())
    tmp.replace(out)
    return PackResult(raw_h.hexdigest(), blob_h.hexdigest(), written, size, data)
