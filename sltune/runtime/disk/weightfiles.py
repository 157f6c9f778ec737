"""The dtype copy of the weights in files, one per unit (`param_offload: disk`), read ahead into a bounded window.

Under `optimizer_offload: disk` the masters and the optimizer state already live in files; the dtype copy the
device loads was the last per-parameter cost left whole in host memory (2 bytes a parameter under bfloat16). Here
each unit's flat dtype copy is a file of its own, written once from the model's weights and again each time the
unit steps (sltune.runtime.stepping writes the refreshed copy behind). Before the device needs a unit, its file
is read with O_DIRECT (sltune.runtime.disk.direct_io) on a reader thread into a page-aligned buffer of the window;
the device copy is made from it, and the buffer goes back to the window's free list. So host memory holds the
units read ahead and the one being copied (the engine reads one phase ahead: O(k + prefetch depth) units), not
the model; between loads the model's Parameters point at placeholders that hold no memory. Sharded over ranks
(sltune.runtime.sharding) a unit's file holds this rank's shard of it, in this rank's folder, read ahead the same
way before the shard is copied to the device and all-gathered.

Versions. A stepped unit's copy is written as `w{i}-{unit}-v{n}.bin` (as `*.tmp`, flushed with fdatasync, then
renamed: a kill never leaves a torn file under a name that is read), and becomes the one read only when the step
commits (`commit`, after the disk tier's manifest): a step that fails or is skipped deletes what it wrote and the
previous version stays (`abort`), so a rollback of the masters needs no rollback here. The files live in the disk
tier's engine folder (or, for an engine that only generates, a folder of their own with the same lock and
cleanup), which goes with the engine: they are a cache of the weights a checkpoint saves from the masters.

Integrity. Each file's payload is checksummed as it is written (sltune.runtime.disk.checksum) and verified on every
read; a mismatch or a short file is an IntegrityError, one line naming the file, never a step of NaNs. A write that
fails (a full disk, a folder gone read-only or removed) is one line naming the file and the fix, its *.tmp removed,
and the step aborts with the committed copies intact. Nothing after the commit's point of no return raises: an old
version that cannot be deleted is left for the folder's removal.

Crash safety. The folder is a cache of the weights, never resumed from (a resume rebuilds it from a checkpoint), so
a kill at any moment (SLTUNE_CRASH_AT at weights.opened, weights.renamed, weights.committed, or the disk tier's
points) only leaves a dead engine's folder, which the next engine removes (sltune.runtime.disk.folder.remove_stale).
Under the disk tier's disk_versions 1 a unit's committed copy is deleted as soon as its new one is renamed into
place (DiskState.drop, SLTUNE_CRASH_AT=weights.dropped), as the disk tier's blocks are: the files hold one version
of the weights and the one being written; a step failing after that leaves the engine torn, as the disk tier does.
"""

from __future__ import annotations

import errno
import os
import threading
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from sltune.runtime.disk import checksum
from sltune.runtime.counters import IOCounters
from sltune.runtime.disk.direct_io import DirectFiles, aligned_empty, writable_dir
from sltune.runtime.disk.layout import padded
from sltune.runtime.disk.files import IntegrityError
from sltune.runtime.disk.state import DELAY_ENV, DiskState
from sltune.runtime.disk.folder import close_folder, own_folder, remove_stale, safe_name, unlink_quietly
from sltune.runtime.disk.durable import crash_point, fsync_dir

# Measured on qwen2-1.5b (bf16, both on disk, b=1 N=4 seq 32, in one process): 2 spare buffers and 2 writes in flight
# peaked at 5.83 GiB, none and 1 at 5.21 GiB, with step times within noise (30.0-31.4 s against 29.7-30.1 s): a fresh
# buffer costs its page faults, and the freed one goes back to the system (sltune.runtime.hostheap)
WRITES_IN_FLIGHT = 1        # stepped copies waiting for the writer before the stepping thread waits for it
SPARE = 0                   # free buffers the window keeps for reuse (the largest ones)
REFIX = ("nothing else may write in an engine's folder: give offload_dir (--offload-dir) a folder of its own, and "
         "resume from the last checkpoint")


def placeholder(shape: torch.Size | tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Values of the right shape and dtype that take no memory: a Parameter between loads."""
    return torch.zeros((), dtype=dtype).expand(shape)


class WeightFiles:
    """Each unit's dtype copy in a file: written at setup, read ahead before each load, rewritten when it steps."""

    def __init__(self, root: str | Path, counters: IOCounters, disk: DiskState | None = None, rank: int = 0):
        """`disk`: the engine's disk tier, whose folder, files and lock this shares; None: a folder of its own (named
        for `rank`, as the disk tier's is)."""
        if disk is not None:
            self.folder, self.files, self._lock = disk.folder, disk.files, disk.lock
        else:
            root = writable_dir(root)
            remove_stale(root)
            self.folder, lock = own_folder(root, rank)
            self.files = DirectFiles(self.folder, float(os.environ.get(DELAY_ENV, "0") or 0))
            self._lock = threading.Condition()
        self.counters = counters
        self.disk = disk            # under its disk_versions 1 an old copy goes as soon as its new one is in place
        self.version = 0
        self._index: dict[int, int] = {}
        self._current: dict[int, tuple[str, int, int]] = {}     # unit id -> (file, payload bytes, checksum)
        self._new: dict[int, tuple[str, int, int]] = {}         # written this step, not committed yet
        self._reads: dict[int, Future] = {}                     # unit id -> its read-ahead (the main thread's)
        self._free: list[torch.Tensor] = []
        self._held = 0                                          # bytes of window buffers in use
        self.peak_window_bytes = 0
        self._writes: list[Future] = []
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="sltune-weights-read")
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="sltune-weights-write")
        pools = (self._reader, self._writer)
        self._cleanup = weakref.finalize(self, _shutdown, pools) if disk is not None else \
            weakref.finalize(self, _close_own, self.folder, lock, pools)

    @property
    def direct(self) -> bool:
        return self.files.direct

    # -- the window's buffers ----------------------------------------------------------------------------
    def _acquire(self, nbytes: int) -> torch.Tensor:
        """A page-aligned buffer of at least nbytes: the smallest free one that holds it, else a new one."""
        need = padded(nbytes)
        with self._lock:
            fits = [i for i, b in enumerate(self._free) if b.numel() >= need]
            buf = self._free.pop(min(fits, key=lambda i: self._free[i].numel())) if fits else None
            self._held += need if buf is None else buf.numel()
            self.peak_window_bytes = max(self.peak_window_bytes, self._held + sum(b.numel() for b in self._free))
        return buf if buf is not None else aligned_empty(need)

    def give_back(self, buf: torch.Tensor) -> None:
        with self._lock:
            self._held -= buf.numel()
            self._free.append(buf)
            self._free.sort(key=lambda b: b.numel(), reverse=True)
            del self._free[SPARE:]

    @property
    def window_bytes(self) -> int:
        """Host memory the window holds now: buffers in use (read ahead, being copied, stepped) and spare."""
        with self._lock:
            return self._held + sum(b.numel() for b in self._free)

    # -- setup -------------------------------------------------------------------------------------------
    def add(self, unit: Any, buf: torch.Tensor, nbytes: int) -> None:
        """Version 0 of a unit's copy, from a page-aligned buffer holding its nbytes of dtype values."""
        self._index[id(unit)] = index = len(self._index)
        name = f"w{index:04d}-{safe_name(unit.name)}-v0.bin"
        self._current[id(unit)] = (name, nbytes, self._write(name, buf, nbytes, count=False))

    def path_of(self, unit: Any) -> Path:
        """The committed version's file of a unit's weights."""
        return self.folder / self._current[id(unit)][0]

    @property
    def committed(self) -> list[tuple[str, int, int]]:
        """The committed version's files, a unit's each: (file name, payload bytes, checksum)."""
        return list(self._current.values())

    # -- reading -----------------------------------------------------------------------------------------
    def request(self, unit: Any) -> None:
        """Start reading the unit's copy into a window buffer (the reader thread), unless it is already on its way."""
        if id(unit) not in self._reads:
            name, nbytes, digest = self._current[id(unit)]
            self._reads[id(unit)] = self._reader.submit(self._read, unit.name, name, nbytes, digest)

    def values(self, unit: Any) -> torch.Tensor:
        """The unit's flat dtype copy in its window buffer, once read and verified (held until `done`)."""
        self.request(unit)
        try:
            buf = self._reads[id(unit)].result()
        except BaseException:
            self._reads.pop(id(unit), None)
            raise
        return _typed(buf, unit)

    def done(self, unit: Any) -> None:
        """The unit's window buffer back to the free list (its copy to the device has landed, or it is not needed)."""
        fut = self._reads.pop(id(unit), None)
        if fut is None:
            return
        try:
            buf = fut.result()
        except BaseException:       # noqa: BLE001 - a failed read-ahead nobody waits for holds no buffer
            return
        self.give_back(buf)

    def read(self, unit: Any) -> torch.Tensor:
        """The unit's flat dtype copy in a buffer of its own (between steps: a state_dict, a checkpoint)."""
        name, nbytes, digest = self._current[id(unit)]
        buf = aligned_empty(nbytes)
        self._read_into(buf, unit.name, name, nbytes, digest)
        return _typed(buf, unit)

    def _read(self, unit_name: str, name: str, nbytes: int, digest: int) -> torch.Tensor:
        buf = self._acquire(nbytes)
        try:
            self._read_into(buf, unit_name, name, nbytes, digest)
        except BaseException:
            self.give_back(buf)
            raise
        return buf

    def _read_into(self, buf: torch.Tensor, unit_name: str, name: str, nbytes: int, digest: int) -> None:
        if self.disk is not None:       # torn: copies of the failed step's units are gone
            self.disk.check_whole()
        path = self.folder / name
        try:
            moved = self.files.read(path, buf, nbytes)
        except OSError as err:
            if getattr(err, "offload", False):      # the folder itself is gone: say so, not "a truncated file"
                raise
            why = "it ends early" if err.errno == errno.EIO else err.strerror or str(err)
            raise IntegrityError(f"{path}: the weights of {unit_name} are unreadable ({why}; {padded(nbytes)} bytes "
                                 f"were written): a truncated or removed file under offload_dir; {REFIX}") from None
        got = checksum.ONE_SHOT[checksum.NAME](buf[:nbytes].numpy())
        if got != digest:
            raise IntegrityError(f"{path}: checksum mismatch in the weights of {unit_name} ({checksum.NAME} {got:x}, "
                                 f"written as {digest:x}): the file changed after it was written (damaged storage "
                                 f"or another writer); {REFIX}")
        with self._lock:
            self.counters.disk_read_bytes += moved

    # -- a step's new versions ---------------------------------------------------------------------------
    def stage(self, unit: Any, with_values: bool) -> torch.Tensor:
        """A window buffer for the unit's stepped copy (the stepping thread's); `with_values`: holding the
        committed copy first (the values a step without a master updates in place, or frozen ones it keeps)."""
        while len([f for f in self._writes if not f.done()]) >= WRITES_IN_FLIGHT:
            next(f for f in self._writes if not f.done()).exception()
        name, nbytes, digest = self._current[id(unit)]
        buf = self._acquire(nbytes)
        if with_values:
            try:
                self._read_into(buf, unit.name, name, nbytes, digest)
            except BaseException:
                self.give_back(buf)
                raise
        return buf

    def write_behind(self, unit: Any, buf: torch.Tensor) -> None:
        """Write the stepped copy in `buf` (from stage) as the unit's next version; the buffer goes back after."""
        nbytes = self._current[id(unit)][1]
        name = f"w{self._index[id(unit)]:04d}-{safe_name(unit.name)}-v{self.version + 1}.bin"

        def write() -> None:
            try:
                digest = self._write(name, buf, nbytes)
                with self._lock:
                    self._new[id(unit)] = (name, nbytes, digest)
                if self.disk is not None and self.disk.versions == 1:    # the committed copy goes now
                    self.disk.drop(self.folder / self._current[id(unit)][0], "weights")
            finally:
                self.give_back(buf)

        self._writes.append(self._writer.submit(write))

    def _write(self, name: str, buf: torch.Tensor, nbytes: int, count: bool = True) -> int:
        digest = checksum.ONE_SHOT[checksum.NAME](buf[:nbytes].numpy())
        moved = self.files.replace(self.folder / name, buf, nbytes, label="weights")
        if count:
            with self._lock:
                self.counters.disk_write_bytes += moved
        return digest

    def finish(self) -> None:
        """Wait for the step's writes; the first failure is raised."""
        for fut in self._writes:
            fut.result()

    def commit(self) -> None:
        """The step's new copies become the ones read (their renames flushed first); the old files go."""
        self.finish()
        fsync_dir(self.folder)
        old = [self._current[key][0] for key in self._new]
        self._current.update(self._new)
        self._new, self._writes = {}, []
        self.version += 1
        crash_point("weights.committed")
        for name in old:                # garbage from here: a file left (a folder gone read-only) goes with it
            unlink_quietly(self.folder / name)

    def abort(self) -> None:
        """After a failed or skipped step: wait for the writes in flight and delete what the step wrote; the
        committed copies stay."""
        for fut in self._writes:
            try:
                fut.result()
            except BaseException:       # noqa: BLE001 - the step is being abandoned anyway
                pass
        for name, _, _ in self._new.values():
            unlink_quietly(self.folder / name)
        for tmp in self.folder.glob(f"w*-v{self.version + 1}.bin.tmp"):
            unlink_quietly(tmp)
        self._new, self._writes = {}, []

    def drop_reads(self) -> None:
        """Every read-ahead's buffer back (after a failed step)."""
        for key in list(self._reads):
            fut = self._reads.pop(key)
            try:
                self.give_back(fut.result())
            except BaseException:       # noqa: BLE001
                pass


def _typed(buf: torch.Tensor, unit: Any) -> torch.Tensor:
    """The flat dtype values at the front of a uint8 buffer (unit.host is the placeholder giving numel and dtype)."""
    numel, dtype = unit.host.numel(), unit.host.dtype
    return buf[:numel * dtype.itemsize].view(dtype)


def _shutdown(pools: tuple[ThreadPoolExecutor, ...]) -> None:
    for pool in pools:
        pool.shutdown(wait=True)


def _close_own(folder: Path, lock: int, pools: tuple[ThreadPoolExecutor, ...]) -> None:
    _shutdown(pools[1:])
    close_folder(folder, lock, pools[0])
