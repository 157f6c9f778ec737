"""Whole files moved between disk and page-aligned host buffers, with O_DIRECT where the filesystem takes it.

The disk tier (sltune.runtime.disk.state) moves gigabytes of optimizer state per step. Through the page cache
those bytes would be copied once more and, worse, cached: the kernel would fill host memory with the very
state the tier moved out of it, and a read right after a write would report the cache's speed, not the
disk's. O_DIRECT moves them between the device and the buffer. It needs the buffer's address, the file offset
and the length aligned to the device's logical block; here all three are whole pages (4096 bytes, a multiple
of every common block size): buffers start on a page, files are padded to whole pages.

tmpfs (and some FUSE filesystems) refuse O_DIRECT when the file is opened (EINVAL); then the same code runs
buffered, and `direct` says so. Each system call moves at most CHUNK bytes (Linux caps one read or write just
below 2 GiB), sequentially through the file.

A failure of the filesystem under a file of the engine's folder (a full disk, a file size limit, a folder remounted
read-only or removed while training) is an OSError naming the file, with one line saying what happened to
offload_dir and the fix (`failure`), not the system call's bare errno.
"""

from __future__ import annotations

import errno
import os
import resource
import shutil
import time
from pathlib import Path

import torch

from sltune.runtime.disk.layout import PAGE, padded
from sltune.runtime.disk.durable import crash_point

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

    def write(self, path: Path, buf: torch.Tensor, nbytes: int, label: str = "file") -> int:
        """Write buf's first padded(nbytes) bytes as the file `path` (created or truncated), flushed to the device
        (fdatasync) before it returns. Returns the bytes written. `label` names the kind of file for the crash
        points (sltune.runtime.disk.durable): "{label}.opened" once the file exists, empty."""
        if self.write_delay_s:
            time.sleep(self.write_delay_s)
        total = padded(nbytes)
        view = _view(buf)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | self._flags(), 0o600)
        except OSError as err:
            raise self.failure(err, path, "writing") from None
        try:
            crash_point(f"{label}.opened")
            done = 0
            while done < total:
                done += os.pwrite(fd, view[done:min(total, done + CHUNK)], done)
            os.fdatasync(fd)
        except OSError as err:
            raise self.failure(err, path, "writing") from None
        finally:
            os.close(fd)
        return total

    def replace(self, path: Path, buf: torch.Tensor, nbytes: int, label: str = "file") -> int:
        """Write as `path` + ".tmp", flushed, then rename over `path`: a kill never leaves a torn file under a
        name that is read. Returns the bytes written. A failed write removes its *.tmp (a full disk stays no
        fuller than before)."""
        tmp = path.with_name(path.name + ".tmp")
        try:
            moved = self.write(tmp, buf, nbytes, label)
            os.replace(tmp, path)
        except OSError as err:
            try:
                tmp.unlink(missing_ok=True)
            except OSError:
                pass
            raise err if getattr(err, "offload", False) else self.failure(err, path, "writing") from None
        crash_point(f"{label}.renamed")
        return moved

    def read(self, path: Path, buf: torch.Tensor, nbytes: int) -> int:
        """Read the file's first padded(nbytes) bytes into buf. Returns the bytes read."""
        total = padded(nbytes)
        view = _view(buf)
        try:
            fd = os.open(path, os.O_RDONLY | self._flags())
        except FileNotFoundError as err:
            if path.parent == self.folder and not self.folder.is_dir():
                raise self.failure(err, path, "reading") from None
            raise
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

    def failure(self, err: OSError, path: Path, doing: str) -> OSError:
        """The filesystem's failure under a file of this folder as one line naming the file, what happened to
        offload_dir and the fix (the error's `offload` attribute is True). A file elsewhere (a checkpoint's, read
        on resume) keeps its own error."""
        if getattr(err, "offload", False) or path.parent != self.folder:
            return err
        root, code = self.folder.parent, err.errno or errno.EIO
        what = err.strerror or str(err)
        after = "nothing half-written is ever read; then run again (--resume continues from the last checkpoint)"
        if not self.folder.is_dir():
            line = (f"the engine's folder {self.folder} under offload_dir vanished while {doing} it (something else "
                    f"removed it: a cleaner of {root}, another job's rm -r); give offload_dir (--offload-dir) a "
                    f"folder nothing else deletes; {after}")
        elif code in (errno.ENOSPC, errno.EDQUOT):
            line = (f"offload_dir {root} is full ({what}; {_free(root)} free) while {doing} it: free space there or "
                    f"give offload_dir (--offload-dir) a disk with room for the run's files (sltune plan counts "
                    f"them); {after}")
        elif code == errno.EFBIG or (code == errno.EINVAL and _size_limited()):    # O_DIRECT cut short: EINVAL
            line = (f"the file size limit of this process (ulimit -f) stopped {doing} it under offload_dir {root}: "
                    f"raise the limit (ulimit -f unlimited); {after}")
        elif code in (errno.EROFS, errno.EACCES, errno.EPERM):
            line = (f"offload_dir {root} is no longer writable ({what}) while {doing} it: make it writable again "
                    f"(remounted read-only? its permissions changed?) or give offload_dir (--offload-dir) another "
                    f"folder; {after}")
        else:
            line = (f"{doing} it under offload_dir {root} failed ({what}): check the disk (dmesg) or give offload_dir "
                    f"(--offload-dir) another one; {after}")
        out = OSError(code, line, str(path))
        out.offload = True
        return out


def _size_limited() -> bool:
    """This process has a file size limit (ulimit -f): a write past it fails, EFBIG (EINVAL under O_DIRECT, whose
    write the kernel shortens to the limit, off the block size)."""
    return resource.getrlimit(resource.RLIMIT_FSIZE)[0] != resource.RLIM_INFINITY


def _free(folder: Path) -> str:
    """The free space on folder's filesystem, for a message ('?' when it cannot be read)."""
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        return "?"
    return f"{free / 2**20:.1f} MiB"


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
