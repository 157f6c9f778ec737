"""Replacing a small file so that a crash leaves the old one or the new one, never a torn one: written under a
temporary name, flushed, renamed over the file, and the rename flushed with its folder. The disk tier's manifests
and optimizer counters and a checkpoint's manifest are written so."""

from __future__ import annotations

import os
from pathlib import Path


def replace_durably(path: Path, data: bytes, tmp: Path | None = None, folder: bool = True) -> None:
    """`path` holds `data` once this returns, on disk; `tmp` (default: path + '.tmp') is the temporary name.
    folder=False leaves the rename to the caller's next flush of the folder (one for several files)."""
    tmp = tmp or path.with_name(f"{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    if folder:
        fsync_dir(path.parent)


def fsync_dir(folder: Path) -> None:
    """Flush a folder's entries (a rename in it); a filesystem that cannot (EINVAL, EBADF) is left to itself."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
