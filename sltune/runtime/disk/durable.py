"""Replacing a small file so that a crash leaves the old one or the new one, never a torn one: written under a
temporary name, flushed, renamed over the file, and the rename flushed with its folder. The disk tier's manifests
and optimizer counters and a checkpoint's manifest are written so."""

from __future__ import annotations

import os
import signal
from pathlib import Path

CRASH_ENV = "SLTUNE_CRASH_AT"
# the points of the disk tier and the weights files a kill is landed at (sltune.training.checkpoints names its own):
DISK_CRASH_POINTS = (
    "disk.opened",          # a block's new file created as *.tmp, nothing in it yet (a torn file)
    "disk.renamed",         # a block's new file renamed into place, its step not committed
    "disk.dropped",         # disk_versions 1: a block's old file gone after its new one was renamed in (no rollback)
    "weights.dropped",      # disk_versions 1: a unit's old weights file gone after its new one was renamed in
    "disk.committed",       # the disk tier's manifest names the new version; the weights files not yet committed
    "weights.opened",       # a unit's new weights file created as *.tmp, nothing in it yet (a torn file)
    "weights.renamed",      # a unit's new weights file renamed into place, its step not committed
    "weights.committed",    # the new weights files are the ones read; the old ones not yet removed
    "engine.closing",       # an engine's folder being removed, some of its files gone
)
_reached: dict[str, int] = {}


def crash_point(point: str) -> None:
    """SIGKILL this process the n-th time it reaches `point`, when SLTUNE_CRASH_AT says `point[@n]`: the tests
    land a kill -9 at a named moment of a write this way, which a timed kill hits only by luck."""
    spec = os.environ.get(CRASH_ENV)
    if not spec:
        return
    name, _, nth = spec.partition("@")
    if name != point:
        return
    _reached[point] = _reached.get(point, 0) + 1
    if _reached[point] == int(nth or 1):
        os.kill(os.getpid(), signal.SIGKILL)


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
