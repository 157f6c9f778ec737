"""The checksum of the files sltune writes and reads back (the disk tier's blocks, a checkpoint's files): xxh3-64
from the xxhash package (a declared dependency: about 4x zlib's crc32, a few % of a disk read), zlib's crc32 where
it is missing. Files record the name of the one they were summed with, and either is read back."""

from __future__ import annotations

import zlib
from typing import Any, Callable

try:
    import xxhash
except ImportError:         # a declared dependency; crc32 keeps everything working (4x slower to hash) without it
    xxhash = None

NAME = "xxh3_64" if xxhash is not None else "crc32"      # what new files are summed with

# name -> function of a buffer (bytes, a numpy array, a memoryview) giving an int, in one call
ONE_SHOT: dict[str, Callable[[Any], int]] = {"crc32": zlib.crc32}
if xxhash is not None:
    ONE_SHOT["xxh3_64"] = xxhash.xxh3_64_intdigest


class _Crc32:
    """zlib's crc32 behind hashlib's update/hexdigest, for a file read in chunks."""

    def __init__(self) -> None:
        self.value = 0

    def update(self, data: Any) -> None:
        self.value = zlib.crc32(data, self.value)

    def hexdigest(self) -> str:
        return f"{self.value:08x}"


def streaming(name: str) -> Any | None:
    """A fresh hasher (update, hexdigest) for `name`, or None when it is not installed here."""
    if name == "crc32":
        return _Crc32()
    if name == "xxh3_64" and xxhash is not None:
        return xxhash.xxh3_64()
    return None
