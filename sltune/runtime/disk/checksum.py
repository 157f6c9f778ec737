"""The checksum of the files sltune writes and reads back (the disk tier's blocks, a checkpoint's files): xxh3-64
from the xxhash package (a declared dependency: about 4x zlib's crc32, a few % of a disk read), zlib's crc32 where
it is missing. Files record the name of the one they were summed with, and either is read back."""

from __future__ import annotations

import zlib
from typing import Any, BinaryIO, Callable

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


CHUNK = 8 << 20     # bytes read at once while a file is summed in pieces: a 192 MiB block takes 8 MiB of memory


def feed(h: Any, f: BinaryIO, start: int = 0, end: int | None = None) -> None:
    """Stream the open file's bytes from `start` to `end` (None: its end) through the hasher `h`, CHUNK at a time (a
    file shorter than `end` feeds what it has)."""
    view = memoryview(bytearray(CHUNK))
    f.seek(start)
    left = None if end is None else end - start
    while left is None or left > 0:
        n = f.readinto(view if left is None else view[:min(left, CHUNK)])
        if not n:
            break
        h.update(view[:n])
        if left is not None:
            left -= n
