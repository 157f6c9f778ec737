"""Master weights and optimizer state in files, one version per optimizer step (`optimizer_offload: disk`).

Layout. The tensors the optimizer steps (each trainable parameter's float32 master, or a rank's flat shard of a
unit) are packed in the optimizer's order, unit by unit, into blocks of at most BLOCK_NUMEL values; a tensor
larger than that is a block of its own, since a tensor is stepped whole, as the host steps it, so the arithmetic
is the host's to the bit. A block's file holds sections, each the block's values back to back: the float32
master (under mixed precision), then each of the optimizer's state tensors (AdamW: exp_avg, exp_avg_sq), the
whole padded to pages for O_DIRECT (sltune.runtime.direct_io). A frozen parameter's master never changes: each
unit's frozen masters are one file, written once.

A step moves version v to v+1. Blocks are read ahead in the order their gradients become final (the backward's
order) into `DEPTH` page-aligned slots reused from step to step, the largest blocks' sizes, so host memory holds
the dtype copy the device loads, the gradients, and this window; the optimizer steps a block in its slot, the
dtype copy is refreshed from the new master, and the slot is written behind into a new file. Reads and writes
run on a pool of IO_THREADS threads, overlapping each other, the compute and the stepping.

Crash safety: a block's new file is written as `*.tmp`, flushed (fdatasync) and renamed; the step is committed
by renaming `manifest.json` over the last one, which names every block's file of the version, the frozen files
and `optimizer-v{v}.pt` (the optimizer's per-tensor step counts and hyperparameters: all it keeps besides the
tensors). Files of version v are removed only after v+1 is committed, so a kill -9 at any moment leaves the last
complete version readable (`read_committed`). A failed step (an exception) deletes what it wrote and rolls back.

Every engine writes in a folder of its own, `offload_dir/sltune-r{rank}-{pid}-{n}`, held with an advisory lock;
a folder whose lock no process holds (its process was killed) is removed by the next engine that starts there,
and an engine's folder goes when the engine does. Checkpoints hard-link a committed version's files (copied
across filesystems), which new versions never overwrite.
"""

from __future__ import annotations

import fcntl
import itertools
import json
import os
import shutil
import threading
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence, TypeVar

import torch
from torch import nn

from sltune.runtime.direct_io import DirectFiles, aligned_empty, padded, writable_dir
from sltune.runtime.counters import IOCounters

BLOCK_NUMEL = 16 << 20          # values per block (a larger tensor is one block)
DEPTH = 3                       # slots: one read ahead, one stepping, one written behind
IO_THREADS = 4
MANIFEST = "manifest.json"
LOCK = ".lock"
DELAY_ENV = "SLTUNE_DISK_WRITE_DELAY_S"     # emulate a slow disk: seconds of sleep before each file write
T = TypeVar("T")
_names = itertools.count()


@dataclass
class Stepped:
    """One tensor the optimizer steps, and where its values and gradient live."""

    unit: Any                   # the ParamUnit
    offset: int                 # into the unit's flat values (its master, its dtype copy: the same layout)
    numel: int
    shape: torch.Size
    grad: torch.Tensor          # its view of the unit's host gradients
    param: nn.Parameter         # what the optimizer holds (a placeholder between steps when the master is on disk)
    index: int = -1             # its place in the optimizer's parameter list (state_dict's numbering)

    def placeholder(self) -> torch.Tensor:
        """Values of the right shape that take no memory: the Parameter between steps."""
        return torch.zeros((), dtype=torch.float32).expand(self.shape)


@dataclass
class Block:
    index: int
    unit: Any
    items: list[Stepped]
    numel: int
    file: str | None = None             # the committed version's file (None: nothing on disk yet)
    has_state: bool = False             # the committed file holds the optimizer state too

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

    def __init__(self, root: str | Path, counters: IOCounters, master: bool, rank: int = 0):
        self.root = writable_dir(root)
        _remove_stale(self.root)
        self.folder, lock = _own_folder(self.root, rank)
        self.files = DirectFiles(self.folder, float(os.environ.get(DELAY_ENV, "0") or 0))
        self.counters = counters
        self.master = master
        self.blocks: list[Block] = []
        self.frozen: dict[str, tuple[str, list[tuple[int, int]]]] = {}     # unit name -> (file, ranges)
        self.layout: list[tuple[str, torch.dtype]] = []
        self.version = 0
        self.times = IOTimes()
        self._by_unit: dict[int, list[Block]] = {}
        self._slots: list[_Slot] = []
        self._queue: list[Block] = []
        self._loaded: dict[int, _Slot] = {}
        self._writes: list[Future] = []
        self._written: list[Path] = []
        self._lock = threading.Condition()
        self._error: BaseException | None = None
        self._pool = ThreadPoolExecutor(IO_THREADS, thread_name_prefix="sltune-disk")
        self._cleanup = weakref.finalize(self, _close, self.folder, lock, self._pool)

    @property
    def direct(self) -> bool:
        return self.files.direct

    # -- layout ----------------------------------------------------------------------------------
    def add_unit(self, unit, stepped: Sequence[Stepped], master: torch.Tensor | None,
                 frozen: Sequence[tuple[int, int]]) -> None:
        """Pack a unit's stepped tensors into blocks and write version 0: the masters (when they live here) of
        the stepped tensors, and the frozen ranges' masters once. `master` is the unit's flat float32 master,
        which the caller frees after."""
        blocks = pack(stepped, lambda s: s.numel)
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
            name = self._write_file(f"u-{_safe(unit.name)}-frozen.bin", buf, total * 4, count=False)
            self.frozen[unit.name] = (name, frozen)

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
    def begin(self, order: Sequence[Block]) -> None:
        """Start reading the step's blocks in the order they will step, as slots free up."""
        with self._lock:
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
            self._lock.notify_all()

    def _read(self, block: Block, slot: _Slot) -> None:
        if block.file is None:
            return
        start = time.perf_counter()
        moved = self.files.read(self.folder / block.file, slot.buf, self.nbytes(block, block.has_state))
        with self._lock:
            self.counters.disk_read_bytes += moved
            self.times.reads.append((start, time.perf_counter()))

    def wait(self, block: Block) -> _Slot:
        """The block's slot once its read is done (the stepping thread waits here for the disk)."""
        with self._lock:
            while block.index not in self._loaded:
                if self._error is not None:
                    raise self._error
                self._lock.wait()
            slot = self._loaded[block.index]
        slot.read.result()
        return slot

    def write_behind(self, block: Block, slot: _Slot) -> None:
        """Write the stepped block as version v+1; its slot is free once the file is renamed into place."""
        self._writes.append(self._pool.submit(self._write, block, slot))

    def _write(self, block: Block, slot: _Slot) -> None:
        try:
            start = time.perf_counter()
            name = self._write_file(f"b{block.index:05d}-v{self.version + 1}.bin", slot.buf, self.nbytes(block, True))
            with self._lock:
                self._written.append(self.folder / name)
                self.times.writes.append((start, time.perf_counter()))
        except BaseException as err:
            with self._lock:
                self._error = err
                self._lock.notify_all()
            raise
        finally:
            self.release(slot)

    def release(self, slot: _Slot) -> None:
        """A slot back to the window (its block written, or not to be written); the next reads start."""
        with self._lock:
            if slot.block is not None:
                self._loaded.pop(slot.block.index, None)
            slot.block, slot.read = None, None
            self._pump()

    def _write_file(self, name: str, buf: torch.Tensor, nbytes: int, count: bool = True) -> str:
        tmp = self.folder / f"{name}.tmp"
        moved = self.files.write(tmp, buf, nbytes)
        os.replace(tmp, self.folder / name)
        if count:
            with self._lock:
                self.counters.disk_write_bytes += moved
        return name

    def finish_writes(self) -> None:
        """Wait for every write of the step; the first failure is raised."""
        for fut in self._writes:
            fut.result()

    def commit(self, small_state: dict[str, Any]) -> None:
        """Make version v+1 the one on disk: its optimizer counters, then the manifest (renamed into place), then
        version v's files go. Every block must have been written."""
        self.finish_writes()
        new = self.version + 1
        old = [b.file for b in self.blocks if b.file is not None]
        names = {p.name for p in self._written}
        for block in self.blocks:
            name = f"b{block.index:05d}-v{new}.bin"
            if name not in names:
                raise RuntimeError(f"block {block.index} of {block.unit.name} was not written this step")
            block.file, block.has_state = name, True
        self.version = new
        self._commit_manifest(small_state)
        for name in old:
            (self.folder / name).unlink(missing_ok=True)
        (self.folder / f"optimizer-v{new - 1}.pt").unlink(missing_ok=True)
        self._written = []

    def abort(self) -> None:
        """After a failed or skipped step: wait for the transfers in flight, drop what the step wrote, free the
        window. The committed version is untouched."""
        with self._lock:
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
            path.unlink(missing_ok=True)
        for tmp in self.folder.glob(f"*-v{self.version + 1}.bin.tmp"):
            tmp.unlink(missing_ok=True)
        self._writes, self._written, self._error = [], [], None

    def _commit_manifest(self, small_state: dict[str, Any] | None) -> None:
        optimizer = None
        if small_state is not None:
            optimizer = f"optimizer-v{self.version}.pt"
            torch.save(small_state, self.folder / f"{optimizer}.tmp")
            os.replace(self.folder / f"{optimizer}.tmp", self.folder / optimizer)
        write_manifest(self.folder, self.manifest(optimizer))

    def manifest(self, optimizer: str | None) -> dict[str, Any]:
        return {"version": self.version, "master": self.master, "optimizer": optimizer,
                "layout": [[key, str(dtype).removeprefix("torch.")] for key, dtype in self.layout],
                "blocks": [{"file": b.file, "unit": b.unit.name, "numel": b.numel, "has_state": b.has_state,
                            "items": [[s.index, s.numel] for s in b.items]} for b in self.blocks],
                "frozen": {unit: {"file": f, "ranges": r} for unit, (f, r) in self.frozen.items()}}

    # -- between steps -------------------------------------------------------------------------------
    def read_block(self, block: Block, with_state: bool = False) -> Views:
        """A committed block in a buffer of its own (not a slot), for saving and rolling back."""
        slot = _Slot(aligned_empty(self.nbytes(block, True)), 0)
        if block.file is not None:
            self.files.read(self.folder / block.file, slot.buf, self.nbytes(block, with_state and block.has_state))
        return self.views(block, slot)

    def master_of(self, unit, numel: int) -> torch.Tensor:
        """The unit's flat float32 master (its stepped tensors and its frozen ones), read from the committed
        version."""
        flat = torch.empty(numel, dtype=torch.float32)
        for block in self.blocks_of(unit):
            for s, master in zip(block.items, self.read_block(block).masters):
                flat[s.offset:s.offset + s.numel].copy_(master.reshape(-1))
        if unit.name in self.frozen:
            name, ranges = self.frozen[unit.name]
            total = sum(n for _, n in ranges)
            buf = aligned_empty(total * 4)
            self.files.read(self.folder / name, buf, total * 4)
            values, at = buf[:total * 4].view(torch.float32), 0
            for a, n in ranges:
                flat[a:a + n].copy_(values[at:at + n])
                at += n
        return flat

    def link_into(self, folder: Path, small_state: dict[str, Any]) -> None:
        """A checkpoint of the committed version: its files hard-linked into `folder` (copied across filesystems),
        with the optimizer's counters as they are now (the scheduler may have moved the learning rate)."""
        folder.mkdir(parents=True, exist_ok=True)
        files = [b.file for b in self.blocks if b.file is not None] + [f for f, _ in self.frozen.values()]
        for name in files:
            _link(self.folder / name, folder / name)
        manifest = self.manifest("optimizer.pt")
        torch.save(small_state, folder / "optimizer.pt")
        write_manifest(folder, manifest)

    def adopt(self, folder: Path) -> dict[str, Any]:
        """Continue from a checkpoint's files (link_into's): same blocks, or a ValueError saying what differs.
        Returns the optimizer's counters to load."""
        theirs = json.loads((folder / MANIFEST).read_text())
        mine = self.manifest(None)
        if _shape(theirs) != _shape(mine):
            raise ValueError(f"{folder}: its optimizer files were written for another layout (num_live_blocks, "
                             "world size, mixed_precision or optimizer); resume with the knobs the run was saved with")
        for block, entry in zip(self.blocks, theirs["blocks"]):
            if entry["file"] is None:
                continue
            name = f"b{block.index:05d}-v{self.version}.bin"
            (self.folder / name).unlink(missing_ok=True)
            _link(folder / entry["file"], self.folder / name)
            block.file, block.has_state = name, entry["has_state"]
        small = torch.load(folder / theirs["optimizer"], weights_only=True)
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


def write_manifest(folder: Path, manifest: dict[str, Any]) -> None:
    """manifest.json, replaced atomically and flushed with its folder: what names the complete version."""
    tmp = folder / f"{MANIFEST}.tmp"
    with open(tmp, "w") as f:
        json.dump(manifest, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, folder / MANIFEST)
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def pack(items: Sequence[T], numel: Callable[[T], int]) -> list[list[T]]:
    """Items in order, in blocks of at most BLOCK_NUMEL values (a larger item is a block of its own): how a unit's
    stepped tensors go to files, and how the tuner's prior counts them (sltune.tuning.prior)."""
    blocks: list[list[T]] = []
    current: list[T] = []
    size = 0
    for item in items:
        if current and size + numel(item) > BLOCK_NUMEL:
            blocks.append(current)
            current, size = [], 0
        current.append(item)
        size += numel(item)
    return blocks + ([current] if current else [])


def block_sections(numel: int, master: bool,
                   layout: Sequence[tuple[str, torch.dtype]]) -> tuple[int | None, list[int], int]:
    """A block file's layout, for the engine that writes it and for read_committed: the byte offset of its float32
    master section (None without a master), of each optimizer state section (aligned to its dtype), and the
    total."""
    off, at_master = 0, None
    if master:
        at_master, off = 0, numel * 4
    states = []
    for _, dtype in layout:
        off = -(-off // dtype.itemsize) * dtype.itemsize
        states.append(off)
        off += numel * dtype.itemsize
    return at_master, states, off


def read_committed(folder: str | Path) -> dict[str, Any]:
    """The last complete version in an engine's folder (or a checkpoint's): {"version", "optimizer" (the
    counters, or None at version 0), "tensors": {index: {"master": tensor, key: tensor, ...}}}, every
    stepped tensor flat, by its place in the optimizer's parameter list."""
    folder = Path(folder)
    manifest = json.loads((folder / MANIFEST).read_text())
    layout = [(key, getattr(torch, dtype)) for key, dtype in manifest["layout"]]
    tensors: dict[int, dict[str, torch.Tensor]] = {}
    for entry in manifest["blocks"]:
        if entry["file"] is None:
            continue
        data = (folder / entry["file"]).read_bytes()
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        numel = entry["numel"]
        master, states, _ = block_sections(numel, manifest["master"], layout)
        parts: list[tuple[str, torch.Tensor]] = []
        if master is not None:
            parts.append(("master", buf[master:master + numel * 4].view(torch.float32)))
        if entry["has_state"]:
            parts += [(key, buf[off:off + numel * dtype.itemsize].view(dtype))
                      for off, (key, dtype) in zip(states, layout)]
        at = 0
        for index, n in entry["items"]:
            tensors[index] = {key: values[at:at + n].clone() for key, values in parts}
            at += n
    small = torch.load(folder / manifest["optimizer"], weights_only=True) if manifest["optimizer"] else None
    return {"version": manifest["version"], "optimizer": small, "tensors": tensors}


def _shape(manifest: dict[str, Any]) -> Any:
    return (manifest["master"], manifest["layout"],
            [(b["unit"], b["numel"], b["items"]) for b in manifest["blocks"]])


def _link(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:                 # another filesystem (or one without hard links): a copy
        shutil.copyfile(src, dst)


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in name)


def _own_folder(root: Path, rank: int) -> tuple[Path, int]:
    """A fresh folder under root, locked by this process: made under a hidden name, locked, then renamed, so
    no other engine's cleanup sees it unlocked."""
    name = f"sltune-r{rank}-{os.getpid()}-{next(_names)}"
    staging = root / f".{name}"
    staging.mkdir()
    fd = os.open(staging / LOCK, os.O_CREAT | os.O_RDWR, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.replace(staging, root / name)
    return root / name, fd


def _remove_stale(root: Path) -> None:
    """Folders of engines whose process is gone (killed: nothing removed them) hold gigabytes: remove them."""
    for folder in root.glob("sltune-r*"):
        try:
            fd = os.open(folder / LOCK, os.O_RDWR)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)            # held: a live engine's
            continue
        shutil.rmtree(folder, ignore_errors=True)
        os.close(fd)


def _close(folder: Path, lock: int, pool: ThreadPoolExecutor) -> None:
    pool.shutdown(wait=True)
    shutil.rmtree(folder, ignore_errors=True)
    os.close(lock)
