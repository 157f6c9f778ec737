"""Whole files moved between disk and page-aligned host buffers, with O_DIRECT where the filesystem takes it.

The disk tier (sltune.runtime.diskstate) moves gigabytes of optimizer state per step. Through the page cache
those bytes would be copied once more and, worse, cached: the kernel would fill host memory with the very
state the tier moved out of it, and a read right after a write would report the cache's speed, not the
disk's. O_DIRECT moves them between the device and the buffer. It needs the buffer's address, the file offset
and the length aligned to the device's logical block; here all three are whole pages (4096 bytes, a multiple
of every common block size): buffers start on a page, files are padded to whole pages.

tmpfs (and some FUSE filesystems) refuse O_DIRECT when the file is opened (EINVAL); then the same code runs
buffered, and `direct` says so. Each system call moves at most CHUNK bytes (Linux caps one read or write just
below 2 GiB), sequentially through the file.
"""

from __future__ import annotations

import errno
import os
import time
from pathlib import Path

import torch

from sltune.runtime.disk_layout import PAGE, padded

CHUNK = 64 << 20


def aligned_empty(nbytes: int) -> torch.Tensor:
    """A uint8 host buffer of padded(nbytes) bytes starting on a page boundary (O_DIRECT's rule)."""
    span = max(PAGE, padded(nbytes))
    raw = torch.empty(span + PAGE, dtype=torch.uint8)
    start = (-raw.data_ptr()) % PAGE
    return raw[start:start + span]


def _view(buf: torch.Tensor) -> memoryview:
    return memoryview(buf.numpy()).cast("B")


class DirectFiles:
    """Reads and writes whole files of a folder; O_DIRECT unless the folder's filesystem refuses it."""

    def __init__(self, folder: Path, write_delay_s: float = 0.0):
        """`write_delay_s`: sleep before each write, emulating a slow disk (tests use it to catch a step
        mid-write)."""
        self.folder = folder
        self.write_delay_s = write_delay_s
        self.direct = hasattr(os, "O_DIRECT") and self._accepts_direct()

    def _accepts_direct(self) -> bool:
        probe = self.folder / ".direct-probe"
        try:
            fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o600)
        except OSError as err:
            if err.errno == errno.EINVAL:
                return False
            raise
        try:
            os.pwrite(fd, _view(aligned_empty(PAGE).zero_()), 0)
            return True
        except OSError as err:
            if err.errno == errno.EINVAL:
                return False
            raise
        finally:
            os.close(fd)
            probe.unlink(missing_ok=True)

    def _flags(self) -> int:
        return os.O_DIRECT if self.direct else 0

    def write(self, path: Path, buf: torch.Tensor, nbytes: int) -> int:
        """Write buf's first padded(nbytes) bytes as the file `path` (created or truncated), flushed to the device
        (fdatasync) before it returns. Returns the bytes written."""
        if self.write_delay_s:
            time.sleep(self.write_delay_s)
        total = padded(nbytes)
        view = _view(buf)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | self._flags(), 0o600)
        try:
            done = 0
            while done < total:
                done += os.pwrite(fd, view[done:min(total, done + CHUNK)], done)
            os.fdatasync(fd)
        finally:
            os.close(fd)
        return total

    def replace(self, path: Path, buf: torch.Tensor, nbytes: int) -> int:
        """Write as `path` + ".tmp", flushed, then rename over `path`: a kill never leaves a torn file under a
        name that is read. Returns the bytes written."""
        tmp = path.with_name(path.name + ".tmp")
        moved = self.write(tmp, buf, nbytes)
        os.replace(tmp, path)
        return moved

    def read(self, path: Path, buf: torch.Tensor, nbytes: int) -> int:
        """Read the file's first padded(nbytes) bytes into buf. Returns the bytes read."""
        total = padded(nbytes)
        view = _view(buf)
        fd = os.open(path, os.O_RDONLY | self._flags())
        try:
            done = 0
            while done < total:
                got = os.preadv(fd, [view[done:min(total, done + CHUNK)]], done)
                if got == 0:
                    raise OSError(errno.EIO, f"{path} ends after {done} of {total} bytes: a torn or foreign file")
                done += got
        finally:
            os.close(fd)
        return total


def writable_dir(path: str | Path, field: str = "offload_dir") -> Path:
    """The folder, created if missing, once a file can be written in it; else a ValueError naming `field` and the
    fix."""
    folder = Path(path).expanduser()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".sltune-write-probe-{os.getpid()}"
        probe.write_bytes(b"x")
        probe.unlink()
    except OSError as err:
        raise ValueError(f"{field} {folder}: not writable ({err.strerror or err}); give a directory this process can "
                         "write, on a local disk with room for the optimizer's files") from None
    return folder.resolve()
