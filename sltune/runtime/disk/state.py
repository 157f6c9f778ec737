"""Master weights and optimizer state in files, one version per optimizer step (`optimizer_offload: disk`).

Layout. The tensors the optimizer steps (each trainable parameter's float32 master, or a rank's flat shard of a
unit) are packed in the optimizer's order, unit by unit, into blocks of at most BLOCK_NUMEL values; a tensor
larger than that is cut into slices of BLOCK_NUMEL values (disk_layout.pieces), each stepped as the tensor from the
counters it had before its first slice (sltune.runtime.stepping), so the arithmetic is the host's to the bit and
the slots are a block's size, not the largest tensor's. The manifest names each slice by its tensor's index, in
order; read_committed puts them back together. A block's file holds sections, each the block's values back to
back: the float32 master (under mixed precision), then each of the optimizer's state tensors (AdamW: exp_avg,
exp_avg_sq), the whole padded to pages for O_DIRECT (sltune.runtime.disk.direct_io). A frozen parameter's master never
changes: each unit's frozen masters are one file, written once.

A step moves version v to v+1. Blocks are read ahead in the order their gradients become final (the backward's
order) into `DEPTH` page-aligned slots reused from step to step, the largest blocks' sizes, so host memory holds
the dtype copy the device loads, the gradients, and this window; the optimizer steps a block in its slot, the
dtype copy is refreshed from the new master, and the slot is written behind into a new file. Reads and writes
run on a pool of IO_THREADS threads, overlapping each other, the compute and the stepping.

Crash safety: a block's new file is written as `*.tmp`, flushed (fdatasync) and renamed; the step is committed
by renaming `manifest.json` over the last one, which names every block's file of the version, the frozen files
and `optimizer-v{v}.pt` (the optimizer's per-tensor step counts and hyperparameters: all it keeps besides the
tensors). Files of version v are removed only after v+1 is committed, so a kill -9 at any moment leaves the last
complete version readable (`read_committed`). A failed step (an exception) deletes what it wrote and rolls back,
a failure to write the new manifest (a full disk) included: the engine keeps naming version v, as the folder does.
A kill lands at a named moment with SLTUNE_CRASH_AT (sltune.runtime.disk.durable.DISK_CRASH_POINTS), as the tests do.

One version (`disk_versions: 1`). The two versions a step holds buy only a rollback of a step that fails in-process
and a readable folder after a kill: `--resume` always starts from a checkpoint, whose hard links keep the inodes of
the version it saved (a new version never overwrites an inode, and unlinking drops only the folder's link). So
under disk_versions 1 each block's version-v file is unlinked as soon as its v+1 file is renamed into place (on the
IO thread, `drop`), and the disk holds one version and the window's blocks in flight instead of two versions. The
step's first drop renames `manifest.json` aside as `manifest.torn.json` (no space needed): from then until the
commit writes the new manifest (and removes the marker) the folder has no complete version, and load_manifest /
read_committed of it say so in one line. A step that fails after that cannot roll back: `abort` deletes what it
wrote and what is left of version v's blocks, and the engine is torn (`torn`): any further step, checkpoint
(link_into) or read of a master (read_block, master_of) raises TornError saying to resume from the last checkpoint
(or to keep disk_versions 2). A failure before the first drop (in the backward before any block is written, an
optimizer raising on the first block) rolls back as under 2. A kill at any moment leaves a folder no resume reads;
SLTUNE_CRASH_AT=disk.dropped[@n] lands one right after an old file went (weights.dropped for param_offload disk's
weights files, which drop their old copy the same way: sltune.runtime.disk.weightfiles).

Integrity: every file's payload is checksummed as it is written (xxh3_64 from the xxhash package; zlib's crc32
where xxhash is missing), one sum per section, kept in the manifest beside the file's name, and verified whenever
the file is read: each step's read-ahead, the reads for a checkpoint or a rollback (read_block, master_of), a
resume (check_files as --resume picks the checkpoint, then adopt, which verifies every file before linking it
unless check_files found that very file whole) and read_committed. The optimizer's counters file is
checksummed whole. A mismatch, a short file, a malformed manifest or a manifest naming a file outside its folder
(an absolute path, `..`, a symlink pointing out) is an IntegrityError: one line naming the file. Hashing runs on
the IO threads (both hashes release the GIL). Measured (bench/disk_checksum.py, a 2-core VM): xxh3 hashes a
192 MiB block at 25-29 GB/s, 4-6% of the time its O_DIRECT read takes (1.2-1.7 GB/s), and a llama-small step
verifying every read is within noise of one without checksums (-1% to +2%); zlib's crc32 (6.6-7 GB/s) is 18-25%
of a read. Manifests written before checksums (no "checksum" key) are read unverified, and checksummed from the
next version on.

Every engine writes in a folder of its own, `offload_dir/sltune-r{rank}-{pid}-{n}`, held with an advisory lock;
a folder whose lock no process holds (its process was killed) is removed by the next engine that starts there,
and an engine's folder goes when the engine does, its lock file last (so a kill meanwhile leaves a folder the next
engine removes too). A filesystem failure under the folder (full, read-only, removed) is one line naming the file
and the fix (DirectFiles.failure). Checkpoints hard-link a committed version's files (copied
across filesystems), which new versions never overwrite.
"""

from __future__ import annotations

import itertools
import os
import shutil
import threading
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import nn

from sltune.runtime.counters import IOCounters
from sltune.runtime.disk import layout as disk_layout
from sltune.runtime.disk import manifest as manifest_file
from sltune.runtime.disk.direct_io import DirectFiles, aligned_empty, writable_dir
from sltune.runtime.disk.durable import crash_point
from sltune.runtime.disk.files import (CHECKSUM, MANIFEST, TORN, TORN_FIX, IntegrityError, TornError, block_sections,
                                       check_size, checksums, file_sections, found_whole, load_manifest, load_small,
                                       member, parse_sums, save_small, verify)
from sltune.runtime.disk.folder import close_folder, own_folder, remove_stale, safe_name, unlink_quietly
from sltune.runtime.disk.layout import DEPTH, pack, padded, pieces

IO_THREADS = 4


DELAY_ENV = "SLTUNE_DISK_WRITE_DELAY_S"     # emulate a slow disk: seconds of sleep before each file write


VERIFY_READS = True             # verify each step's read-ahead too (not only resumes, checkpoints and rollbacks)


@dataclass
class Stepped:
    """One tensor the optimizer steps, and where its values and gradient live."""

    unit: Any                   # the ParamUnit
    offset: int                 # into the unit's flat values (its master, its dtype copy: the same layout)
    numel: int
    shape: torch.Size
    grad: torch.Tensor | None   # its view of the unit's host gradients (None between steps in a GradWindow)
    param: nn.Parameter         # what the optimizer holds (a placeholder between steps when the master is on disk)
    index: int = -1             # its place in the optimizer's parameter list (state_dict's numbering)
    part: int | None = None     # a slice of a tensor larger than a block: where in the tensor it starts
    whole: torch.Size | None = None     # ... and the tensor's shape

    def placeholder(self) -> torch.Tensor:
        """Values of the right shape that take no memory: the Parameter between steps."""
        return torch.zeros((), dtype=self.param.dtype).expand(self.whole or self.shape)

    def sliced(self) -> list["Stepped"]:
        """The tensor as the disk tier steps it: whole, or in slices of a block each (disk_layout.pieces), each a
        flat view of its values and gradient."""
        cuts = pieces(self.numel)
        if len(cuts) == 1:
            return [self]
        flat = self.grad.reshape(-1) if self.grad.stride() and self.grad.is_contiguous() else None
        return [Stepped(self.unit, self.offset + a, n, torch.Size([n]),
                        flat[a:a + n] if flat is not None else torch.zeros((), dtype=self.grad.dtype).expand(n),
                        self.param, self.index, a, self.shape) for a, n in cuts]


@dataclass
class Block:
    index: int
    unit: Any
    items: list[Stepped]
    numel: int
    file: str | None = None             # the committed version's file (None: nothing on disk yet)
    has_state: bool = False             # the committed file holds the optimizer state too
    sums: list[int] | None = None       # the committed file's checksum per section (file_sections's order)

    @property
    def offsets(self) -> list[int]:
        return list(itertools.accumulate([0] + [s.numel for s in self.items[:-1]]))


@dataclass
class _Slot:
    buf: torch.Tensor
    capacity: int
    block: Block | None = None
    read: Future | None = None


@dataclass
class Views:
    """A block's tensors in its slot: per stepped tensor, its master (None without one) and its state tensors."""

    masters: list[torch.Tensor | None]
    states: list[list[torch.Tensor]]


@dataclass
class IOTimes:
    """When each transfer ran (perf_counter seconds), for the step's timeline."""

    reads: list[tuple[float, float]] = field(default_factory=list)
    writes: list[tuple[float, float]] = field(default_factory=list)


class DiskState:
    """The optimizer's files of one engine: layout, the window of slots, read-ahead, write-behind, commit."""

    def __init__(self, root: str | Path, counters: IOCounters, master: bool, rank: int = 0, versions: int = 2):
        """`versions`: 2 keeps version v until v+1 commits (a failed step rolls back); 1 drops each old file as
        its new one lands (half the disk; a failed step leaves the engine torn)."""
        if versions not in (1, 2):
            raise ValueError(f"disk_versions is {versions!r}; use 1 or 2")
        self.versions = versions
        self.torn: str | None = None        # why this engine cannot step on (a failed step under disk_versions 1)
        self._dropped = False               # this step dropped a file of the committed version
        self.root = writable_dir(root)
        remove_stale(self.root)
        self.folder, lock = own_folder(self.root, rank)
        self.files = DirectFiles(self.folder, float(os.environ.get(DELAY_ENV, "0") or 0))
        self.counters = counters
        self.master = master
        self.blocks: list[Block] = []
        self.frozen: dict[str, tuple[str, list[tuple[int, int]], int]] = {}    # unit name -> (file, ranges, sum)
        self.verify_reads = VERIFY_READS
        self.layout: list[tuple[str, torch.dtype]] = []
        self.version = 0
        self.times = IOTimes()
        self._by_unit: dict[int, list[Block]] = {}
        self._slots: list[_Slot] = []
        self._queue: list[Block] = []
        self._loaded: dict[int, _Slot] = {}
        self._writes: list[Future] = []
        self._written: list[Path] = []
        self._sums: dict[str, list[int]] = {}       # this step's written files -> their sums
        self.lock = threading.Condition()   # the pump's; the gradient window (gradwindow) does its I/O under it
        self._error: BaseException | None = None
        self._pool = ThreadPoolExecutor(IO_THREADS, thread_name_prefix="sltune-disk")
        self._cleanup = weakref.finalize(self, close_folder, self.folder, lock, self._pool)

    @property
    def direct(self) -> bool:
        return self.files.direct

    @property
    def dropped(self) -> bool:
        """This step has dropped a file of the committed version (disk_versions 1: it can no longer roll back)."""
        return self._dropped

    # -- layout ----------------------------------------------------------------------------------
    def add_unit(self, unit, stepped: Sequence[Stepped], master: torch.Tensor | None,
                 frozen: Sequence[tuple[int, int]]) -> None:
        """Pack a unit's stepped tensors into blocks and write version 0: the masters (when they live here) of
        the stepped tensors, and the frozen ranges' masters once. `master` is the unit's flat float32 master,
        which the caller frees after."""
        blocks = pack([piece for s in stepped for piece in s.sliced()], lambda s: s.numel)
        mine = [Block(len(self.blocks) + i, unit, items, sum(s.numel for s in items)) for i, items in enumerate(blocks)]
        self.blocks += mine
        self._by_unit[id(unit)] = mine
        if master is None:
            return
        for block in mine:
            if block.numel == 0:
                continue
            buf = aligned_empty(block.numel * 4)
            flat = buf[:block.numel * 4].view(torch.float32)
            for s, off in zip(block.items, block.offsets):
                flat[off:off + s.numel].copy_(master[s.offset:s.offset + s.numel])
            block.sums = checksums(buf, self._ranges(block, False))
            block.file = self._write_file(f"b{block.index:05d}-v0.bin", buf, block.numel * 4, count=False)
        frozen = [(a, n) for a, n in frozen if n > 0]
        if frozen:
            total = sum(n for _, n in frozen)
            buf = aligned_empty(total * 4)
            flat = buf[:total * 4].view(torch.float32)
            at = 0
            for a, n in frozen:
                flat[at:at + n].copy_(master[a:a + n])
                at += n
            name = self._write_file(f"u-{safe_name(unit.name)}-frozen.bin", buf, total * 4, count=False)
            self.frozen[unit.name] = (name, frozen, checksums(buf, [(0, total * 4)])[0])

    def blocks_of(self, unit) -> list[Block]:
        return self._by_unit.get(id(unit), [])

    def configure(self, layout: list[tuple[str, torch.dtype]], optimizer: torch.optim.Optimizer) -> None:
        """The optimizer's per-value state (from sltune.runtime.stepping.state_layout): sizes the slots (the
        DEPTH largest blocks) and numbers the stepped tensors as the optimizer's state_dict does; then
        commits version 0, so the folder is readable from the start."""
        self.layout = layout
        index = {id(p): i for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"])}
        for block in self.blocks:
            for s in block.items:
                s.index = index[id(s.param)]
        sizes = sorted((self.nbytes(b, True) for b in self.blocks), reverse=True)[:DEPTH]
        self._slots = [_Slot(aligned_empty(n), padded(n)) for n in sizes]
        self._commit_manifest(None)

    def _sections(self, block: Block) -> tuple[int | None, list[int], int]:
        return block_sections(block.numel, self.master, self.layout)

    def _ranges(self, block: Block, with_state: bool) -> list[tuple[int, int]]:
        return [(a, b) for _, a, b in file_sections(block.numel, self.master, self.layout, with_state)]

    def nbytes(self, block: Block, with_state: bool) -> int:
        """The payload of a block's file: its master section, and its state when it has one."""
        master, states, total = self._sections(block)
        return total if with_state else (block.numel * 4 if master is not None else 0)

    @property
    def window_bytes(self) -> int:
        """Host memory the slots take: the DEPTH largest blocks, master and state, padded."""
        return sum(s.capacity for s in self._slots)

    def views(self, block: Block, slot: _Slot) -> Views:
        master, states, _ = self._sections(block)
        buf, out_m, out_s = slot.buf, [], []
        for s, off in zip(block.items, block.offsets):
            if master is None:
                out_m.append(None)
            else:
                a = master + 4 * off
                out_m.append(buf[a:a + 4 * s.numel].view(torch.float32).view(s.shape))
            mine = []
            for base, (_, dtype) in zip(states, self.layout):
                a = base + dtype.itemsize * off
                mine.append(buf[a:a + dtype.itemsize * s.numel].view(dtype).view(s.shape))
            out_s.append(mine)
        return Views(out_m, out_s)

    # -- one step ----------------------------------------------------------------------------------
    def check_whole(self) -> None:
        """A torn engine (a failed step under disk_versions 1) has nothing whole to step, save or read."""
        if self.torn is not None:
            raise TornError(self.torn)

    def begin(self, order: Sequence[Block]) -> None:
        """Start reading the step's blocks in the order they will step, as slots free up."""
        self.check_whole()
        with self.lock:
            self._queue = list(order)
            self._loaded, self._writes, self._written, self._error = {}, [], [], None
            self.times = IOTimes()
            self._pump()

    def _pump(self) -> None:
        """Give the next blocks in order a free slot that holds them (the smallest) and start their reads.
        Called with the lock held."""
        while self._queue:
            block = self._queue[0]
            need = padded(self.nbytes(block, True))
            free = [s for s in self._slots if s.block is None and s.capacity >= need]
            if not free:
                return
            slot = min(free, key=lambda s: s.capacity)
            self._queue.pop(0)
            slot.block = block
            slot.read = self._pool.submit(self._read, block, slot)
            self._loaded[block.index] = slot
            self.lock.notify_all()

    def _read(self, block: Block, slot: _Slot) -> None:
        if block.file is None:
            return
        try:
            start = time.perf_counter()
            moved = self.files.read(self.folder / block.file, slot.buf, self.nbytes(block, block.has_state))
            end = time.perf_counter()
            if self.verify_reads:
                self._verify(block, slot.buf, block.has_state)
        except BaseException as err:    # the step fails: every block waited for from now on raises it too
            with self.lock:
                self._error = self._error or err
                self.lock.notify_all()
            raise
        with self.lock:
            self.counters.disk_read_bytes += moved
            self.times.reads.append((start, end))

    def wait(self, block: Block) -> _Slot:
        """The block's slot once its read is done (the stepping thread waits here for the disk)."""
        with self.lock:
            while block.index not in self._loaded:
                if self._error is not None:
                    raise self._error
                self.lock.wait()
            slot = self._loaded[block.index]
        slot.read.result()
        return slot

    def interrupt(self, error: BaseException) -> None:
        """The step failed: whoever waits for a block raises instead of waiting for a read that will not come (the
        slots may hold blocks nobody will step)."""
        with self.lock:
            self._error = self._error or error
            self.lock.notify_all()

    def write_behind(self, block: Block, slot: _Slot) -> None:
        """Write the stepped block as version v+1; its slot is free once the file is renamed into place."""
        self._writes.append(self._pool.submit(self._write, block, slot))

    def _write(self, block: Block, slot: _Slot) -> None:
        try:
            sums = checksums(slot.buf, self._ranges(block, True))
            start = time.perf_counter()
            name = self._write_file(f"b{block.index:05d}-v{self.version + 1}.bin", slot.buf, self.nbytes(block, True))
            with self.lock:
                self._written.append(self.folder / name)
                self._sums[name] = sums
                self.times.writes.append((start, time.perf_counter()))
            if self.versions == 1 and block.file is not None:
                self.drop(self.folder / block.file)
        except BaseException as err:
            with self.lock:
                self._error = err
                self.lock.notify_all()
            raise
        finally:
            self.release(slot)

    def drop(self, path: Path, label: str = "disk") -> None:
        """disk_versions 1: a file of the committed version whose replacement is in place goes now (the weights
        files' too). The step's first drop sets the manifest aside first (TORN): from here the folder holds no
        complete version until the commit, and a failed step cannot roll back."""
        with self.lock:
            if not self._dropped:
                try:
                    os.replace(self.folder / MANIFEST, self.folder / TORN)
                except OSError as err:
                    raise self.files.failure(err, self.folder / MANIFEST, "writing") from None
                self._dropped = True
        unlink_quietly(path)
        crash_point(f"{label}.dropped")

    def release(self, slot: _Slot) -> None:
        """A slot back to the window (its block written, or not to be written); the next reads start."""
        with self.lock:
            if slot.block is not None:
                self._loaded.pop(slot.block.index, None)
            slot.block, slot.read = None, None
            self._pump()

    def _write_file(self, name: str, buf: torch.Tensor, nbytes: int, count: bool = True) -> str:
        moved = self.files.replace(self.folder / name, buf, nbytes, label="disk")
        if count:
            with self.lock:
                self.counters.disk_write_bytes += moved
        return name

    def _verify(self, block: Block, buf: torch.Tensor, with_state: bool, path: Path | None = None,
                checksum: str | None = None) -> None:
        """The sections of a block's committed file just read into buf (the master only, or all) against its sums."""
        if block.sums is None:
            return
        sections = file_sections(block.numel, self.master, self.layout, with_state)
        verify(path or self.folder / block.file, buf, sections, block.sums[:len(sections)], checksum or CHECKSUM)

    def finish_writes(self) -> None:
        """Wait for every write of the step; the first failure is raised."""
        for fut in self._writes:
            fut.result()

    def commit(self, small_state: dict[str, Any]) -> None:
        """Make version v+1 the one on disk: its optimizer counters, then the manifest (renamed into place), then
        version v's files go. Every block must have been written."""
        self.check_whole()
        self.finish_writes()
        new = self.version + 1
        old = [b.file for b in self.blocks if b.file is not None]
        names = {p.name for p in self._written}
        for block in self.blocks:
            if f"b{block.index:05d}-v{new}.bin" not in names:
                raise RuntimeError(f"block {block.index} of {block.unit.name} was not written this step")
        before = [(b.file, b.has_state, b.sums) for b in self.blocks]
        for block in self.blocks:
            name = f"b{block.index:05d}-v{new}.bin"
            block.file, block.has_state, block.sums = name, True, self._sums[name]
        self.version = new
        try:
            self._commit_manifest(small_state)
        except BaseException:       # (a full disk) the manifest still names version v: so does this engine
            for block, (file, has_state, sums) in zip(self.blocks, before):
                block.file, block.has_state, block.sums = file, has_state, sums
            self.version = new - 1
            for name in (f"optimizer-v{new}.pt", f"optimizer-v{new}.pt.tmp", manifest_file.TMP):
                unlink_quietly(self.folder / name)
            raise
        crash_point("disk.committed")
        # committed: what follows only tidies (a file left behind goes with the folder), so it raises nothing
        for name in old:                # under disk_versions 1 dropped already, as each new file landed
            unlink_quietly(self.folder / name)
        unlink_quietly(self.folder / f"optimizer-v{new - 1}.pt")
        if self._dropped:               # the new manifest names a whole version again
            unlink_quietly(self.folder / TORN)
        self._dropped = False
        self._written, self._sums = [], {}

    def abort(self) -> None:
        """After a failed or skipped step: wait for the transfers in flight, drop what the step wrote, free the
        window. The committed version is untouched, unless files of it were dropped (disk_versions 1): then the
        engine is torn, and what is left of that version's blocks goes too (the manifest stays set aside)."""
        with self.lock:
            self._queue = []
        for slot in self._slots:
            if slot.read is not None:
                try:
                    slot.read.result()
                except BaseException:       # noqa: BLE001 - the step is being abandoned anyway
                    pass
        for fut in self._writes:
            try:
                fut.result()
            except BaseException:           # noqa: BLE001
                pass
        for slot in self._slots:
            self.release(slot)
        for path in self._written:
            unlink_quietly(path)
        for tmp in self.folder.glob(f"*-v{self.version + 1}.bin.tmp"):
            unlink_quietly(tmp)
        if self._dropped:
            self.torn = self.torn or (
                f"{self.folder}: a step failed mid-way under disk_versions 1, after it had replaced some of the "
                f"optimizer's files, so this engine holds no complete version to roll back to or go on from; "
                f"{TORN_FIX}")
            for block in self.blocks:
                if block.file is not None:
                    unlink_quietly(self.folder / block.file)
            self._dropped = False
        self._writes, self._written, self._sums, self._error = [], [], {}, None

    def _commit_manifest(self, small_state: dict[str, Any] | None) -> None:
        optimizer, digest = None, None
        path = self.folder / MANIFEST
        try:
            if small_state is not None:
                optimizer = f"optimizer-v{self.version}.pt"
                path = self.folder / optimizer
                digest = save_small(path, small_state)
                path = self.folder / MANIFEST
            manifest_file.write(self.folder, self.manifest(optimizer, digest))
        except OSError as err:      # a full disk, a folder gone read-only or removed: one line, with the fix
            raise self.files.failure(err, path, "writing") from None

    def manifest(self, optimizer: str | None, optimizer_sum: int | None = None) -> dict[str, Any]:
        return {"version": self.version, "master": self.master, "optimizer": optimizer, "checksum": CHECKSUM,
                "optimizer_sum": None if optimizer_sum is None else f"{optimizer_sum:x}",
                "layout": [[key, str(dtype).removeprefix("torch.")] for key, dtype in self.layout],
                "blocks": [{"file": b.file, "unit": b.unit.name, "numel": b.numel, "has_state": b.has_state,
                            "items": [[s.index, s.numel] for s in b.items],
                            "sums": None if b.sums is None else [f"{x:x}" for x in b.sums]} for b in self.blocks],
                "frozen": {unit: {"file": f, "ranges": r, "sum": f"{x:x}"} for unit, (f, r, x) in self.frozen.items()}}

    # -- between steps -------------------------------------------------------------------------------
    def read_block(self, block: Block, with_state: bool = False) -> Views:
        """A committed block in a buffer of its own (not a slot), for saving and rolling back."""
        self.check_whole()
        slot = _Slot(aligned_empty(self.nbytes(block, True)), 0)
        if block.file is not None:
            with_state = with_state and block.has_state
            self.files.read(self.folder / block.file, slot.buf, self.nbytes(block, with_state))
            self._verify(block, slot.buf, with_state)
        return self.views(block, slot)

    def master_of(self, unit, numel: int) -> torch.Tensor:
        """The unit's flat float32 master (its stepped tensors and its frozen ones), read from the committed
        version."""
        self.check_whole()
        flat = torch.empty(numel, dtype=torch.float32)
        for block in self.blocks_of(unit):
            for s, master in zip(block.items, self.read_block(block).masters):
                flat[s.offset:s.offset + s.numel].copy_(master.reshape(-1))
        if unit.name in self.frozen:
            name, ranges, digest = self.frozen[unit.name]
            total = sum(n for _, n in ranges)
            buf = aligned_empty(total * 4)
            self.files.read(self.folder / name, buf, total * 4)
            verify(self.folder / name, buf, [("frozen", 0, total * 4)], [digest], CHECKSUM)
            values, at = buf[:total * 4].view(torch.float32), 0
            for a, n in ranges:
                flat[a:a + n].copy_(values[at:at + n])
                at += n
        return flat

    def link_into(self, folder: Path, small_state: dict[str, Any]) -> None:
        """A checkpoint of the committed version: its files hard-linked into `folder` (copied across filesystems),
        with the optimizer's counters as they are now (the scheduler may have moved the learning rate)."""
        self.check_whole()
        folder.mkdir(parents=True, exist_ok=True)
        files = [b.file for b in self.blocks if b.file is not None] + [f for f, _, _ in self.frozen.values()]
        for name in files:
            _link(self.folder / name, folder / name)
        manifest_file.write(folder, self.manifest("optimizer.pt", save_small(folder / "optimizer.pt", small_state)))

    def adopt(self, folder: Path) -> dict[str, Any]:
        """Continue from a checkpoint's files (link_into's): same blocks, or a ValueError saying what differs.
        Every file is verified against its checksums before it is linked (an IntegrityError naming it): read here,
        unless this process read it whole already, unchanged since (check_files, as --resume picks the checkpoint).
        Returns the optimizer's counters to load."""
        folder = Path(folder)
        theirs = load_manifest(folder)
        mine = self.manifest(None)
        if _shape(theirs) != _shape(mine):
            if any(n > disk_layout.BLOCK_NUMEL for b in theirs["blocks"] for _, n in b["items"]):
                raise ValueError(f"{folder}: its optimizer files keep a tensor over {disk_layout.BLOCK_NUMEL} "
                                 "values in one block, as sltune did before it stepped such tensors in slices; "
                                 "resume it with the sltune that saved it, or start from its weights (the "
                                 "checkpoint's model folder)")
            raise ValueError(f"{folder}: its optimizer files were written for another layout (num_live_blocks, "
                             "world size, mixed_precision or optimizer); resume with the knobs the run was saved with")
        if theirs["optimizer"] is None:
            raise IntegrityError(f"{folder / MANIFEST}: names no optimizer file, as only an engine's first version "
                                 "does; a checkpoint's always has one (a damaged or foreign folder)")
        small = load_small(folder, theirs)
        buf = max((s.buf for s in self._slots), key=lambda b: b.numel(), default=None)    # idle between steps
        sums: dict[int, list[int]] = {}
        for block, entry in zip(self.blocks, theirs["blocks"]):
            if entry["file"] is None:
                continue
            path = member(folder, entry["file"])
            probe = Block(block.index, block.unit, block.items, block.numel, entry["file"], entry["has_state"],
                          parse_sums(entry))
            need = self.nbytes(probe, probe.has_state)
            check_size(path, need)
            if theirs["checksum"] == CHECKSUM and probe.sums is not None and found_whole(
                    path, file_sections(block.numel, self.master, self.layout, probe.has_state), probe.sums, CHECKSUM):
                sums[block.index] = probe.sums      # read whole when --resume picked the checkpoint: not again
                continue
            if buf is None or buf.numel() < padded(need):
                buf = aligned_empty(need)
            self.files.read(path, buf, need)
            self._verify(probe, buf, probe.has_state, path, theirs["checksum"])
            # this engine's own sums (the same unless the checkpoint used another checksum, or none)
            sums[block.index] = (probe.sums if theirs["checksum"] == CHECKSUM and probe.sums is not None
                                 else checksums(buf, self._ranges(probe, probe.has_state)))
        for block, entry in zip(self.blocks, theirs["blocks"]):
            if entry["file"] is None:
                continue
            name = f"b{block.index:05d}-v{self.version}.bin"
            try:
                (self.folder / name).unlink(missing_ok=True)
                _link(folder / entry["file"], self.folder / name)
            except OSError as err:      # copied across filesystems onto a full disk, say
                raise self.files.failure(err, self.folder / name, "writing") from None
            block.file, block.has_state, block.sums = name, entry["has_state"], sums[block.index]
        self._commit_manifest(small)
        return small


def state_layout(factory, dtype: torch.dtype) -> list[tuple[str, torch.dtype]]:
    """The optimizer's state per value: the tensors its state holds shaped like the parameter, found by stepping
    a throwaway optimizer from the same factory on a zero parameter. AdamW: exp_avg and exp_avg_sq."""
    probe = nn.Parameter(torch.zeros(8, dtype=dtype))
    probe.grad = torch.zeros_like(probe)
    opt = factory([probe])
    opt.step()
    return [(key, value.dtype) for key, value in opt.state[probe].items()
            if torch.is_tensor(value) and value.shape == probe.shape]


def _shape(manifest: dict[str, Any]) -> Any:
    return (manifest["master"], manifest["layout"],
            [(b["unit"], b["numel"], b["items"]) for b in manifest["blocks"]])


def _link(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:                 # another filesystem (or one without hard links): a copy
        shutil.copyfile(src, dst)
