"""Checkpoints a job can resume from exactly: a Hugging Face folder plus `training_state/`, complete or refused.

    DIR/                               what transformers loads (config.json, safetensors, the run's tokenizer files)
    DIR/training_state/trainer.pt      step, run id, data position, scheduler, loss scale, RNG, save dtype, world size
    DIR/training_state/optimizer-rank{r}-of-{W}.pt   each rank's optimizer state (its shard when sharded)
    DIR/training_state/optimizer-rank{r}-of-{W}/     ... under optimizer_offload disk: the files of the engine's
                                                     last committed step (hard links: no second copy), a
                                                     manifest, and the optimizer's counters (optimizer.pt)
    DIR/training_state/weights.safetensors           the weights as stepped (the float32 masters), when the
                                                     folder's weights are in another dtype
    DIR/training_state/manifest.json   written last: the step, the run, and every file of the checkpoint with its
                                       size and checksum (xxh3_64 from xxhash, else zlib's crc32; a file hard-linked
                                       from the disk tier by its size: its folder's own manifest sums its blocks)
    DIR/.sltune-lock                   held (flock) by the run saving into DIR; names its pid and host

One writer. A run with --save holds DIR/.sltune-lock (an exclusive flock, rank 0, for the whole run; the kernel
drops it when the process dies); a second run on the same folder is refused in one line naming the holder. Only
the holder finishes or removes what a dead run left (`recover`), so whatever it finds there is dead by
construction, on any host and in any PID namespace.

One unit. A checkpoint is written whole into a hidden sibling (`.sltune-ckpt-{pid}-checkpoint-{N}` beside
DIR/checkpoint-N, `DIR/.sltune-save-{pid}` for the final DIR), each file flushed, the manifest last; then made
visible: a checkpoint-N folder by one rename (atomic: a reader sees the old folder or the new one), the final DIR
by moving the files in one by one and `training_state/` (with the manifest) last. That last move is not atomic
for a raw reader of DIR (transformers' from_pretrained during the move can read new weights with an old config);
for sltune it is: a kill at any moment leaves the last checkpoint or the new one, because a unit whose manifest
was written is complete and the next run (`--resume`, `--save` or `--model` on DIR) finishes moving it in, while a
`--model DIR` that a live run is moving into is refused. Recovery finishes a unit only when it is newer than what
it would replace (by its manifest's save time, then step) and never over a checkpoint-N that verifies; anything
else a dead run left (older or unfinished units, tombstones, the temporary files of older versions) is removed. A
fresh run or --overwrite finishes no unit: it discards them (a fresh run without --overwrite is refused when one
is complete).

Verified. `latest` resumes the newest checkpoint whose manifest verifies: every listed file present with its size,
trainer.pt and every safetensors file naming the manifest's step and run, and every checksum, the disk tier's
hard-linked blocks read whole against their own manifest's (remembered by inode, mtime and size, so the engine
adopting them reads none again; bench/resume_verify.py: 1.5 s/GB from a cold page cache, 0.4 warm). One that does
not is skipped with a line naming the file, and refused when nothing older verifies. Under several ranks rank 0
picks and verifies the checkpoint and the others load the one it names (`agree`).

Deleted whole. A checkpoint is deleted by renaming it to a tombstone first, so no half-deleted folder is ever seen
under its name. `prune` counts the complete checkpoints of this run only, keeps the newest, and runs after the new
one is complete.

Ranks fail together. Each phase of a save (and the start-up cleanup, and rotation) ends with every rank gathering
every rank's error line (`together`), so a rank that fails does not leave the others waiting at a collective: all
raise the same line.

SLTUNE_CRASH_AT=point[@n] kills the process (SIGKILL) the n-th time it reaches a point of CRASH_POINTS: the tests
and bench/checkpoint_soak.py kill at each write and rename with it.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
import shutil
import socket
import sys
import time
import uuid
from pathlib import Path, PurePosixPath
from typing import Any, Callable, Iterator, TypeVar

import torch
import torch.distributed as dist

from sltune.runtime import checksum
from sltune.runtime.durable import CRASH_ENV, crash_point, fsync_dir, replace_durably  # noqa: F401

TRAINING_STATE = "training_state"
TRAINER = "trainer.pt"
WEIGHTS = "weights.safetensors"
MANIFEST = "manifest.json"
LOCK = ".sltune-lock"
FORMAT = 1
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")
# what a run leaves while it writes or deletes (the pid is the writing run's rank 0; it names, it decides nothing):
#   .sltune-save-{pid}                   the final folder's next contents
#   .sltune-ckpt-{pid}-checkpoint-{N}    a checkpoint-N being written
#   .sltune-trash-{pid}-{name}           a tombstone: a folder being deleted
#   .sltune-tmp-{pid}                    write_pretrained's own staging (engine.save_pretrained)
_LEFTOVER = re.compile(r"^\.sltune-(?P<kind>save|ckpt|trash|tmp)-(?P<pid>\d+)(?:-(?P<name>.+))?$")
_TOKENIZER_TMP = re.compile(r"^\..+\.sltune-tmp-(?P<pid>\d+)$")     # write_tokenizer_files' temporary files
_OLD_LEFTOVERS = (".training_state.tmp", ".training_state.old")      # what sltune before manifests left

CRASH_POINTS = (
    "save.staged",          # the unit's folder made, nothing in it
    "save.weights",         # the weights and config written
    "save.tokenizer",       # the tokenizer files written
    "save.optimizer",       # this rank's optimizer state written
    "save.exact",           # weights.safetensors written
    "save.trainer",         # trainer.pt written
    "save.manifest",        # the manifest written: the unit is complete, not yet visible
    "commit.tombstoned",    # an older checkpoint-N of the same name moved aside
    "commit.renamed",       # checkpoint-N visible; its tombstone not yet removed
    "final.file",           # one file moved into the final folder (each file reaches it)
    "final.stale",          # the old layout's files removed from the final folder
    "final.tombstoned",     # the final folder's old training_state moved aside
    "final.committed",      # the new training_state in place; the staging and tombstone not yet removed
    "discard.renamed",      # a folder being deleted renamed to its tombstone, not yet removed
)


# -- checksums ---------------------------------------------------------------------------------------------------
HASH = checksum.NAME        # what a save sums its files with (sltune.runtime.checksum, as the disk tier's blocks)
_CHUNK = 8 << 20


def hash_file(path: Path, algo: str, sync: bool = False) -> str | None:
    """The file's checksum by `algo` (None when that algorithm is not installed here); `sync` also flushes the
    file to disk, as it is read."""
    h = checksum.streaming(algo)
    if h is None:
        return None
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    with open(path, "rb") as f:
        while n := f.readinto(buf):
            h.update(view[:n])
        if sync:
            os.fsync(f.fileno())
    return h.hexdigest()


def record(path: Path) -> dict[str, Any]:
    """A file's manifest entry, the file flushed to disk: its size and checksum, or only its size for a file
    hard-linked from the disk tier's folder (its blocks carry their own checksums; reading them here would read
    the whole optimizer state back at every checkpoint)."""
    st = path.stat()
    if st.st_nlink > 1:
        return {"size": st.st_size, "linked": True}
    return {"size": st.st_size, HASH: hash_file(path, HASH, sync=True)}


# -- ranks -------------------------------------------------------------------------------------------------------
T = TypeVar("T")


def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def new_run_id() -> str:
    return uuid.uuid4().hex[:12]


def together(fn: Callable[[], T], gather: bool = False) -> Any:
    """Run this rank's part of a phase (`fn`), then gather every rank's error line, so a rank that fails does not
    leave the others waiting at the next collective: when any rank failed, every rank raises the first failed
    rank's line (an OSError naming its file, else a ValueError or, for anything else, a RuntimeError). Returns fn's
    result, or with `gather` the list of every rank's."""
    rank, world = _rank_world()
    error: BaseException | None = None
    result: Any = None
    try:
        result = fn()
    except Exception as err:   # noqa: BLE001 - every rank must hear of it, whatever it is
        error = err
    if world == 1:
        if error is not None:
            raise error
        return [result] if gather else result
    said = _said(error) if error is not None else None
    parts: list[Any] = [None] * world
    dist.all_gather_object(parts, (said, result if gather and error is None else None))
    for k, (line, _) in enumerate(parts):
        if line is not None:
            raise _unsaid(line, k) from error
    return [r for _, r in parts] if gather else result


def _said(err: BaseException) -> tuple[str, ...]:
    if isinstance(err, OSError):
        return ("OSError", str(err.errno or errno.EIO), str(err.strerror or err), str(err.filename or ""))
    kind = "ValueError" if isinstance(err, ValueError) else type(err).__name__
    return (kind, " ".join(str(err).split()))


def _unsaid(said: tuple[str, ...], rank: int) -> Exception:
    if said[0] == "OSError":
        _, code, reason, file = said
        return OSError(int(code), f"on rank {rank}: {reason}", file or None)
    if said[0] == "ValueError":
        return ValueError(f"on rank {rank}: {said[1]}")
    return RuntimeError(f"on rank {rank}: {said[0]}: {said[1]}")


# -- the folder's lock -------------------------------------------------------------------------------------------
class FolderBusy(ValueError):
    """Another live process holds a folder's .sltune-lock: one line naming it and its holder."""

    def __init__(self, message: str, holder: str) -> None:
        super().__init__(message)
        self.holder = holder


class _Held:
    def __init__(self, fd: int) -> None:
        self.fd, self.refs, self.recovered = fd, 0, False


_HELD: dict[str, _Held] = {}


def _forget_locks() -> None:
    """In a forked child: the parent's locks are not the child's (flock belongs to the open file description the
    two share, so the child closes its copies and never unlocks them)."""
    for held in _HELD.values():
        with contextlib.suppress(OSError):
            os.close(held.fd)
    _HELD.clear()


os.register_at_fork(after_in_child=_forget_locks)


class FolderLock:
    """This process's hold on a folder's .sltune-lock (counted: a run holds it while it also recovers under it);
    release() is idempotent, and the kernel releases it when the process exits."""

    def __init__(self, key: str, held: _Held) -> None:
        self.key, self._held = key, held

    @property
    def held(self) -> _Held | None:
        return self._held

    def release(self) -> None:
        held, self._held = self._held, None
        if held is None or _HELD.get(self.key) is not held:
            return
        held.refs -= 1
        if held.refs == 0:
            del _HELD[self.key]
            os.close(held.fd)           # drops the flock: no other descriptor of ours shares it


def hold(folder: str | Path, flag: str = "--save") -> FolderLock:
    """Take `folder`'s .sltune-lock (made with the folder when missing) for this process: a FolderBusy naming the
    lock file and its holder's pid and host when another process holds it."""
    folder = Path(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        key = str(folder.resolve())
        held = _HELD.get(key)
        if held is None:
            fd = os.open(folder / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as err:
                holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "a process"
                os.close(fd)
                if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise FolderBusy(f"{flag} {folder}: another run is saving into it ({holder} holds "
                                     f"{folder / LOCK}); wait for it to end, or --save another folder",
                                     f"{holder} holds {folder / LOCK}") from None
                raise
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"pid {os.getpid()} on host {socket.gethostname()}\n".encode(), 0)
            held = _HELD[key] = _Held(fd)
    except FolderBusy:
        raise
    except OSError as err:
        raise OSError(err.errno or errno.EIO, f"cannot lock it for this run ({err.strerror or err}); --save a "
                      "folder on a filesystem this process can write and lock", str(folder / LOCK)) from None
    held.refs += 1
    return FolderLock(key, held)


# -- saving ------------------------------------------------------------------------------------------------------
def save_checkpoint(path: str | Path, engine, trainer: dict[str, Any], save_dtype: torch.dtype,
                    max_shard_size: int | str = "5GB", tokenizer: dict[str, bytes] | None = None,
                    owner: int | None = None, periodic: bool = False) -> Path:
    """Write the model as a Hugging Face folder at `path` with the run's `tokenizer` files (read_tokenizer_files at
    its start) and the state a resume needs beside it, as one unit (a collective when sharded: every rank calls it,
    each writes its optimizer state while rank 0 writes the model; rank 0 then writes the manifest and publishes).
    `periodic`: `path` is a checkpoint-N folder of the run, published by one rename beside the others; else it is
    the run's --save folder, its files replaced in place. `trainer` holds the step and the run id ("run"); `owner`
    is rank 0's pid, which names the unit. A failure on any rank is raised on every rank (`together`)."""
    path = Path(path)
    rank, world = _rank_world()
    step, run = int(trainer["step"]), trainer.get("run")
    if world > 1 and (owner is None or run is None):        # every rank names the same folders and run
        agreed = [owner or os.getpid(), run or new_run_id()]
        dist.broadcast_object_list(agreed, src=0)
        owner, run = agreed
    owner, run = owner or os.getpid(), str(run or new_run_id())
    root = path.parent if periodic else path
    staging = root / (f".sltune-ckpt-{owner}-{path.name}" if periodic else f".sltune-save-{owner}")
    meta = {"sltune_step": str(step), "sltune_run": run}
    state = engine.state_dict()                    # a collective when sharded
    published = False
    try:
        together(lambda: _stage(root, staging, path) if rank == 0 else None)   # then every rank writes at once

        def write() -> dict[str, Any]:
            if rank == 0:
                _write_model(staging, path, engine, state, save_dtype, max_shard_size, meta, tokenizer)
            return _write_optimizer(staging, path, engine, rank, world)

        files = {k: v for part in together(write, gather=True) for k, v in part.items()}

        def finish() -> None:
            if rank == 0:
                _write_rank0_state(staging, path, engine, state, save_dtype, meta,
                                   {**trainer, "step": step, "run": run, "world_size": world})
                _write_unit_manifest(staging, path, files, step, run, world)
                _publish(staging, path, owner, periodic)

        together(finish)
        published = True
    finally:
        if not published and rank == 0 and staging.is_dir() and not (staging / TRAINING_STATE / MANIFEST).is_file():
            _rmtree(staging)            # a failed save (a full disk) leaves nothing behind to keep the disk full
    return path


def _stage(root: Path, staging: Path, path: Path) -> None:
    with _writing(staging, path, root):
        root.mkdir(parents=True, exist_ok=True)
        _rmtree(staging)
        (staging / TRAINING_STATE).mkdir(parents=True)
    crash_point("save.staged")


def _write_model(staging: Path, path: Path, engine, state: dict[str, torch.Tensor], save_dtype: torch.dtype,
                 max_shard_size: int | str, meta: dict[str, str], tokenizer: dict[str, bytes] | None) -> None:
    """Rank 0: the Hugging Face part (weights, config, the run's tokenizer files)."""
    from sltune.models.checkpoint import write_pretrained, write_tokenizer_files

    with _writing(staging, path):
        write_pretrained(staging, engine.model, engine.untied(state), save_dtype, max_shard_size, metadata=meta,
                         staged=False)
    crash_point("save.weights")
    with _writing(staging, path):
        write_tokenizer_files(staging, tokenizer or {})
    crash_point("save.tokenizer")


def _write_optimizer(staging: Path, path: Path, engine, rank: int, world: int) -> dict[str, Any]:
    """Every rank: its optimizer state (its files linked from the disk tier under optimizer_offload disk), and
    their manifest entries."""
    mine = f"{TRAINING_STATE}/optimizer-rank{rank}-of-{world}"
    on_disk = getattr(engine, "disk", None) is not None
    # a wrapped backend's own (sltune.training.wrapped): FSDP2's by parameter name, none for DeepSpeed (no resume)
    own = getattr(engine, "optimizer_state", None)
    with _writing(staging, path, staging / (mine if on_disk else f"{mine}.pt")):
        if on_disk:
            engine.disk.link_into(staging / mine, engine.optimizer.state_dict())
            written = sorted(p for p in (staging / mine).rglob("*") if p.is_file())
        else:
            state = own() if own is not None else engine.optimizer.state_dict()
            if state is not None:
                torch.save(state, staging / f"{mine}.pt")
            written = [staging / f"{mine}.pt"] if state is not None else []
        files = {p.relative_to(staging).as_posix(): record(p) for p in written}
    crash_point("save.optimizer")
    return files


def _write_rank0_state(staging: Path, path: Path, engine, state: dict[str, torch.Tensor], save_dtype: torch.dtype,
                       meta: dict[str, str], trainer: dict[str, Any]) -> None:
    """Rank 0: the float32 weights as stepped (when the folder's are in another dtype) and trainer.pt."""
    stepped = {n: t for n, t in state.items() if t.is_floating_point()}
    if any(t.dtype != save_dtype for t in stepped.values()):
        from safetensors.torch import save_file

        exact = {name: t.detach().contiguous() for name, t in engine.untied(stepped).items()}
        with _writing(staging, path, staging / TRAINING_STATE / WEIGHTS):
            save_file(exact, staging / TRAINING_STATE / WEIGHTS, metadata={"format": "pt", **meta})
        crash_point("save.exact")
    with _writing(staging, path, staging / TRAINING_STATE / TRAINER):
        torch.save({**trainer, "save_dtype": str(save_dtype).removeprefix("torch."),
                    "scaler": engine.scaler.state_dict() if engine.scaler is not None else None,
                    "rng": torch.get_rng_state()}, staging / TRAINING_STATE / TRAINER)
    crash_point("save.trainer")


def _write_unit_manifest(staging: Path, path: Path, files: dict[str, Any], step: int, run: str, world: int) -> None:
    """Rank 0, last: every file of the unit (the ranks' optimizer files as they recorded them) flushed and listed;
    from here on the unit is complete."""
    with _writing(staging, path):
        files = dict(files)
        for p in sorted(staging.rglob("*")):
            rel = p.relative_to(staging).as_posix()
            if p.is_file() and rel not in files:
                files[rel] = record(p)
        for folder in [*(p for p in staging.rglob("*") if p.is_dir()), staging]:
            fsync_dir(folder)
        _write_manifest(staging / TRAINING_STATE, {"format": FORMAT, "step": step, "run": run, "world_size": world,
                                                   "saved_at": time.time(), "files": dict(sorted(files.items()))})
    crash_point("save.manifest")


def _publish(staging: Path, path: Path, owner: int, periodic: bool) -> None:
    if periodic:
        _commit_folder(staging, path, owner)
    else:
        _swap_in(path, staging, owner)


def _write_manifest(folder: Path, manifest: dict[str, Any]) -> None:
    replace_durably(folder / MANIFEST, json.dumps(manifest, indent=1).encode(), tmp=folder / f".{MANIFEST}.tmp")


def _commit_folder(staging: Path, path: Path, owner: int) -> None:
    """Make a complete checkpoint-N visible with one rename; an older folder of that name goes to a tombstone."""
    trash = None
    if path.exists():
        trash = path.parent / f".sltune-trash-{owner}-{path.name}"
        _rmtree(trash)
        os.replace(path, trash)
        crash_point("commit.tombstoned")
    os.replace(staging, path)
    fsync_dir(path.parent)
    crash_point("commit.renamed")
    if trash is not None:
        _rmtree(trash)


def _swap_in(root: Path, unit: Path, owner: int) -> None:
    """Move a complete unit's files into the final folder, `training_state/` (with the manifest) last; the old
    layout's weight files and another tokenizer's files go. Run again on what is left after a kill, it finishes the
    move (recover). Not atomic for a reader of `root` that ignores the manifest (see the module's docstring)."""
    from sltune.models.checkpoint import INDEX, TOKENIZER_FILES

    manifest = _manifest(unit)
    if manifest is None:
        raise Incomplete(f"{unit / TRAINING_STATE / MANIFEST}: missing or unreadable; the unit is not complete")
    listed = {rel.split("/", 1)[0] for rel in manifest["files"]}
    for item in sorted(unit.iterdir()):
        if item.name != TRAINING_STATE:
            os.replace(item, root / item.name)
            crash_point("final.file")
    stale = [*root.glob("model*.safetensors"), root / INDEX]
    if any(name in listed for name in TOKENIZER_FILES):
        stale += [root / name for name in TOKENIZER_FILES]
    for file in stale:
        if file.name not in listed and file.is_file():
            file.unlink()
    crash_point("final.stale")
    old = root / TRAINING_STATE
    trash = root / f".sltune-trash-{owner}-{TRAINING_STATE}"
    if old.exists():
        _rmtree(trash)
        os.replace(old, trash)
        crash_point("final.tombstoned")
    os.replace(unit / TRAINING_STATE, old)
    fsync_dir(root)
    crash_point("final.committed")
    _rmtree(trash)
    _rmtree(unit)


def _write_failure(err: BaseException) -> bool:
    """A failure of the filesystem under a write (a full disk, a quota, a lost mount): an OSError, safetensors'
    SafetensorError, or torch's '[enforce fail at inline_container.cc]' / 'PytorchStreamWriter failed' RuntimeError.
    Anything else is a bug, raised as it is."""
    if isinstance(err, OSError):
        return True
    if type(err).__name__ == "SafetensorError":
        return True
    text = str(err)
    return isinstance(err, RuntimeError) and ("enforce fail" in text or "PytorchStreamWriter" in text
                                              or "file write failed" in text)


@contextlib.contextmanager
def _writing(staging: Path, target: Path, file: Path | None = None) -> Iterator[None]:
    """A failure writing a checkpoint (a full disk: torch's '[enforce fail at inline_container.cc]', safetensors'
    'I/O error') as one line naming the file as it would have been seen and the fix."""
    try:
        yield
    except Exception as err:   # noqa: BLE001 - only the filesystem's failures are translated (_write_failure)
        if not _write_failure(err):
            raise
        if isinstance(err, OSError) and err.filename is not None:
            file = Path(err.filename)
        name = file or target
        with contextlib.suppress(ValueError):
            name = target / Path(name).relative_to(staging)
        reason = " ".join(str(getattr(err, "strerror", None) or err).split())
        try:
            free = shutil.disk_usage(target.parent if not target.exists() else target).free
            space = f"; {free / 2**20:.1f} MiB free on its disk"
        except OSError:
            space = ""
        code = err.errno if isinstance(err, OSError) and err.errno else errno.EIO
        raise OSError(code, f"could not save the checkpoint ({reason}){space}: free space (or --save to another "
                            f"disk) and continue with --resume; the checkpoint before it is intact",
                      str(name)) from err


# -- reading -----------------------------------------------------------------------------------------------------
class Incomplete(ValueError):
    """A checkpoint folder whose manifest does not verify: a line naming the file."""


def _manifest(folder: Path) -> dict[str, Any] | None:
    """A checkpoint folder's (or a unit's) manifest when it is there and reads as one: files, step, run, world
    size. None otherwise."""
    try:
        manifest = json.loads((folder / TRAINING_STATE / MANIFEST).read_text())
        if not isinstance(manifest, dict) or not isinstance(manifest["files"], dict):
            return None
        int(manifest["step"]), str(manifest["run"]), int(manifest["world_size"]), float(manifest.get("saved_at", 0))
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return manifest


def _load(file: Path) -> Any:
    """torch.load of a checkpoint's .pt file, a torn or foreign one as one line naming it."""
    try:
        return torch.load(file, weights_only=True)
    except FileNotFoundError:
        raise Incomplete(f"{file}: missing; the checkpoint is incomplete") from None
    except Exception as err:   # noqa: BLE001 - UnpicklingError, a truncated zip, [Errno 22]: not this file's
        reason = " ".join(str(err).split())[:160]
        raise Incomplete(f"{file}: not a checkpoint file torch can read ({type(err).__name__}: {reason}); it is "
                         "damaged or not sltune's: resume from an earlier checkpoint-N, or train without "
                         "--resume") from None


def verify(folder: str | Path, checksums: bool = True) -> tuple[dict[str, Any], dict[str, Any]]:
    """(manifest, trainer state) of a complete checkpoint: its manifest lists every file with its size, the parts
    every checkpoint has are there, trainer.pt and the safetensors files name the manifest's step and run (cheap:
    a mix of two checkpoints is found before any file is read whole), then (`checksums`) every file's checksum.
    Anything else is an Incomplete naming the file."""
    folder = Path(folder)
    state = folder / TRAINING_STATE
    mfile = state / MANIFEST
    if not mfile.is_file():
        legacy = (state / TRAINER).is_file()
        why = "a save or delete that did not finish" + (", or an sltune before checkpoint manifests wrote it, "
                                                        "whose parts cannot be shown to belong together; to start "
                                                        f"from its weights alone, pass --model {folder} without "
                                                        "--resume" if legacy else "")
        raise Incomplete(f"{mfile}: missing, so {folder} is no complete checkpoint ({why})")
    manifest = _manifest(folder)
    if manifest is None:
        raise Incomplete(f"{mfile}: not a checkpoint manifest (unreadable, or without its files, step, run or "
                         "world size)")
    files: dict[str, dict[str, Any]] = manifest["files"]
    step, run, world = int(manifest["step"]), str(manifest["run"]), int(manifest["world_size"])
    for rel, entry in files.items():
        file = folder / rel
        if Path(rel).is_absolute() or ".." in Path(rel).parts:
            raise Incomplete(f"{mfile}: names {rel}, outside its checkpoint")
        try:
            size = file.stat().st_size
        except FileNotFoundError:
            raise Incomplete(f"{file}: missing (listed in {mfile}); the checkpoint is incomplete") from None
        if size != entry.get("size"):
            raise Incomplete(f"{file}: {size} bytes where {mfile} lists {entry.get('size')}: truncated or replaced")
    has_weights = "model.safetensors" in files or "model.safetensors.index.json" in files
    need = ["config.json", f"{TRAINING_STATE}/{TRAINER}"] + [f"{TRAINING_STATE}/optimizer-rank{r}-of-{world}"
                                                            for r in range(world)]
    missing = [n for n in need if n not in files and not any(k.startswith(n + ".") or k.startswith(n + "/")
                                                             for k in files)]
    if missing or not has_weights:
        raise Incomplete(f"{mfile}: lists no {(missing or ['model.safetensors'])[0]}; not a whole checkpoint")
    trainer = _load(state / TRAINER)
    if not isinstance(trainer, dict) or str(trainer.get("step")) != str(step) or trainer.get("run") != run:
        said = (f"step {trainer.get('step')} of run {trainer.get('run')}" if isinstance(trainer, dict) else "no step")
        raise Incomplete(f"{state / TRAINER}: {said}, but {mfile} is step {step} of run {run}: parts of two "
                         "checkpoints")
    for rel in files:
        if rel.endswith(".safetensors"):
            theirs = _weights_tag(folder / rel)
            if theirs is not None and theirs != (str(step), run):
                raise Incomplete(f"{folder / rel}: the weights of step {theirs[0]} of run {theirs[1]}, but {mfile} "
                                 f"is step {step} of run {run}: parts of two checkpoints")
    if checksums:
        for rel, entry in files.items():
            algo = next((a for a in ("xxh3_64", "crc32") if a in entry), None)
            got = hash_file(folder / rel, algo) if algo else None
            if got is not None and got != entry[algo]:
                raise Incomplete(f"{folder / rel}: checksum mismatch ({algo} {got}, {mfile} lists {entry[algo]}): "
                                 "the file is damaged or not this checkpoint's")
        _check_linked(folder, [rel for rel, entry in files.items() if entry.get("linked")])
    return manifest, trainer


def _check_linked(folder: Path, linked: list[str]) -> None:
    """The files a checkpoint hard-linked from the disk tier (listed by size only: summing them at every save would
    read the whole optimizer state back), read whole against the sums of their own folder's manifest, which the
    checkpoint's manifest sums (checked just before). A damaged block is then an Incomplete here, where --resume
    can still pick an older checkpoint, not an error when the engine adopts it; sltune.runtime.diskstate remembers
    the blocks found whole, so adopting them reads none again."""
    from sltune.runtime.diskstate import IntegrityError, check_files

    for sub in sorted({PurePosixPath(rel).parent for rel in linked}):
        try:
            checked = check_files(folder / sub)
        except IntegrityError as err:
            raise Incomplete(str(err).removesuffix("; resume from another checkpoint")) from None
        unchecked = [rel for rel in linked
                     if PurePosixPath(rel).parent == sub and PurePosixPath(rel).name not in checked]
        if unchecked:
            raise Incomplete(f"{folder / unchecked[0]}: listed in {folder / TRAINING_STATE / MANIFEST} as a disk "
                             f"tier's file, but {folder / sub / MANIFEST} names no such file, so nothing can check it")


def _weights_tag(file: Path) -> tuple[str, str] | None:
    from safetensors import safe_open

    try:
        with safe_open(file, framework="pt") as f:
            meta = f.metadata() or {}
    except Exception as err:   # noqa: BLE001 - a torn header
        raise Incomplete(f"{file}: not a safetensors file ({' '.join(str(err).split())[:120]})") from None
    return (meta["sltune_step"], meta.get("sltune_run", "")) if "sltune_step" in meta else None


def read_trainer(folder: Path) -> dict[str, Any] | None:
    """A checkpoint folder's trainer state, or None when it is no complete checkpoint."""
    try:
        return verify(folder, checksums=False)[1]
    except Incomplete:
        return None


def _warn(message: str) -> None:
    if os.environ.get("RANK", "0") == "0":
        print(f"sltune: warning: {message}", file=sys.stderr, flush=True)


def _candidates(path: Path) -> list[Path]:
    """The folders of `path` that are (or were meant to be) checkpoints: itself, when it has a training_state,
    and its checkpoint-N folders."""
    own = [path] if (path / TRAINING_STATE).exists() else []
    return own + sorted((p for p in path.iterdir() if _CHECKPOINT.match(p.name) and p.is_dir()),
                        key=lambda p: int(p.name.split("-")[1]))


def _order(folder: Path) -> tuple[float, float]:
    """Newest first: by the manifest's step (then its save time), else by the folder's number (the folder itself:
    the newest)."""
    manifest = _manifest(folder)
    if manifest is not None:
        return float(manifest["step"]), float(manifest.get("saved_at", 0))
    m = _CHECKPOINT.match(folder.name)
    return (float(m.group(1)) if m else float("inf")), 0.0


def _recover_to_read(path: Path) -> None:
    """Finish what a dead run left in `path` (and, for a checkpoint-N folder, beside it) before reading it, when its
    lock can be taken; a folder a live run holds (or one this process cannot lock, read-only) is read as it is:
    verification then skips what that run has not finished."""
    roots = [path]
    if _CHECKPOINT.match(path.name) and any(_LEFTOVER.match(p.name) for p in path.parent.iterdir()):
        roots.append(path.parent)
    for root in roots:
        with contextlib.suppress(FolderBusy, OSError):
            recover(root)


def latest(path: str | Path, warn: Callable[[str], None] = _warn, recovered: bool = True,
           checksums: bool = True) -> tuple[Path, dict[str, Any]]:
    """The newest complete checkpoint in `path`, verified: the folder itself or one of its checkpoint-{step}
    folders, after what a dead run left there is finished or removed (`recovered`; without it, and without
    `checksums`, a look another rank takes while rank 0 recovers). A newer one that does not verify is skipped
    with a line (`warn`) naming the file; none verifying is a ValueError naming the newest one's."""
    path = Path(path)
    if path.is_file():
        raise ValueError(f"--resume {path}: a file, not a checkpoint folder; give the --save folder of the run to "
                         f"continue (it holds {TRAINING_STATE}/ or checkpoint-N folders)")
    if not path.is_dir():
        raise ValueError(f"--resume {path}: no such folder; give the --save folder of the run to continue")
    if recovered:
        _recover_to_read(path)
    found = sorted(_candidates(path), key=_order, reverse=True)
    if not found:
        raise ValueError(f"--resume {path}: no checkpoint with a {TRAINING_STATE}/{TRAINER} in it or in its "
                         "checkpoint-* folders; a run writes them with --save DIR (and --save-every N)")
    skipped: list[str] = []
    for folder in found:
        try:
            _, trainer = verify(folder, checksums=checksums)
        except Incomplete as err:
            skipped.append(str(err))
            continue
        for reason in skipped:
            warn(f"--resume {path}: skipped a newer checkpoint: {reason}; resuming {folder} (step {trainer['step']})")
        return folder, trainer
    raise ValueError(f"--resume {path}: no complete checkpoint: {skipped[0]}"
                     + (f" (and {len(skipped) - 1} older ones do not verify either)" if len(skipped) > 1 else ""))


def agree(resumed: Path | None, trainer: dict[str, Any] | None) -> tuple[Path | None, dict[str, Any] | None]:
    """Under several ranks, after the process group is joined: the checkpoint rank 0 picked (and verified, checksums
    included), loaded on every rank. Another rank reads that folder's trainer.pt and checks its files' sizes and
    step and run (no checksums: rank 0 read them); a rank that cannot is one line on every rank (`together`)."""
    rank, world = _rank_world()
    if world == 1:
        return resumed, trainer
    choice = [str(resumed) if resumed is not None else None, (trainer or {}).get("step"), (trainer or {}).get("run")]
    dist.broadcast_object_list(choice, src=0)

    def load() -> tuple[Path | None, dict[str, Any] | None]:
        if rank == 0:
            return resumed, trainer
        if choice[0] is None:
            return None, None
        folder = Path(choice[0])
        if resumed is not None and trainer is not None and resumed == folder and \
                (str(trainer.get("step")), trainer.get("run")) == (str(choice[1]), choice[2]):
            return resumed, trainer
        try:
            _, theirs = verify(folder, checksums=False)
        except Incomplete as err:
            raise ValueError(f"{err} (rank 0 resumes {folder}, step {choice[1]}: every rank must see the same "
                             "files; put the --resume folder on a filesystem every node shares)") from None
        if (str(theirs.get("step")), theirs.get("run")) != (str(choice[1]), choice[2]):
            raise ValueError(f"{folder / TRAINING_STATE / TRAINER}: step {theirs.get('step')} of run "
                             f"{theirs.get('run')} here, but rank 0 resumes step {choice[1]} of run {choice[2]} from "
                             "it: every rank must see the same files; put the --resume folder on a filesystem "
                             "every node shares")
        return folder, theirs

    return together(load)


def restore(folder: Path, trainer: dict[str, Any], engine) -> None:
    """Load the optimizer state, the loss scale and the RNG a checkpoint saved into a freshly built engine."""
    rank, world = _rank_world()
    if int(trainer["world_size"]) != world:
        raise ValueError(f"--resume {folder}: saved by {trainer['world_size']} ranks but this run has {world}; "
                         f"resume under torchrun --nproc-per-node {trainer['world_size']} (the optimizer state is "
                         "sharded per rank)")
    saved = folder / TRAINING_STATE / f"optimizer-rank{rank}-of-{world}"
    if saved.is_dir() and getattr(engine, "disk", None) is not None:    # disk to disk: the files, linked
        engine.optimizer.load_state_dict(engine.disk.adopt(saved))
    elif saved.is_dir():                                                # disk to host: read into memory
        engine.optimizer.load_state_dict(_from_files(saved, engine.optimizer))
    else:       # host to either: under disk the first step moves the loaded state into the files
        file = saved.with_suffix(".pt")
        try:
            getattr(engine, "load_optimizer_state", engine.optimizer.load_state_dict)(_load(file))
        except (ValueError, KeyError, TypeError) as err:
            if isinstance(err, Incomplete):
                raise
            raise ValueError(f"{file}: an optimizer state of another model or optimizer ({err}); resume with the "
                             "model and --optimizer the run was saved with") from None
    if trainer.get("scaler") is not None and engine.scaler is not None:
        engine.scaler.load_state_dict(trainer["scaler"])
    torch.set_rng_state(trainer["rng"])


def _from_files(folder: Path, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """An optimizer state_dict from a disk checkpoint's files: its counters and its state tensors."""
    from sltune.runtime.diskstate import read_committed

    saved = read_committed(folder)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    small = saved["optimizer"]
    for index, tensors in saved["tensors"].items():
        entry = small["state"].setdefault(index, {})
        entry.update({key: t.view(params[index].shape) for key, t in tensors.items() if key != "master"})
    return small


def exact_weights(folder: Path) -> Path | None:
    """The weights file a resume reads when the folder's own are in another dtype than the stepped ones."""
    file = folder / TRAINING_STATE / WEIGHTS
    return file if file.is_file() else None


# -- the --save folder: whose it is, leftovers, rotation ---------------------------------------------------------
def _run_of(folder: Path) -> tuple[str | None, int | None]:
    """The run and step a checkpoint folder's manifest names (None, None without a readable one)."""
    manifest = _manifest(folder)
    return (str(manifest["run"]), int(manifest["step"])) if manifest is not None else (None, None)


def _complete_units(root: Path) -> list[Path]:
    """The units a dead run left complete (their manifest written) in `root`."""
    return sorted(p for p in root.iterdir() if (m := _LEFTOVER.match(p.name)) and m.group("kind") in ("save", "ckpt")
                  and (p / TRAINING_STATE / MANIFEST).is_file())


def check_model_folder(folder: str | Path) -> None:
    """--model DIR: a save a killed run left in DIR, complete but not all moved in, leaves DIR's files part old,
    part new; it is finished first (under DIR's lock). A live run saving into DIR (its lock held) is refused."""
    folder = Path(folder)
    if not _complete_units(folder):
        return
    try:
        recover(folder)
    except FolderBusy as err:
        raise ValueError(f"--model {folder}: a run is saving into it ({err.holder}): "
                         f"until that save ends its files are part old, part new; wait for it, then pass --model "
                         f"{folder} (or --resume {folder} to continue that run)") from None


def check_save_folder(save: str | Path, run: str | None, resumed: Path | None, overwrite: bool) -> None:
    """Under the --save folder's lock (hold): finish or remove what a dead run left (recover; a fresh run or
    --overwrite finishes no unit, and a fresh run without --overwrite is refused when one is complete), then refuse
    a folder whose checkpoints rotation or the final save would delete or mix up: another run's (or, for a fresh
    run, any), unfinished ones, or checkpoints of this run newer than the one --resume continues from.
    --overwrite lets the run remove them (remove_old_checkpoints)."""
    save = Path(save)
    if not save.is_dir():
        return
    fresh = resumed is None
    if fresh and not overwrite and (units := _complete_units(save)):
        raise ValueError(f"--save {save} holds {units[0]}, a complete save a killed run did not finish moving in; "
                         f"pass --resume {save} to finish and continue that run, --overwrite to remove it, or --save "
                         "another folder")
    recover(save, finish=not fresh and not overwrite)
    if overwrite:
        return
    resumed_at = resumed.resolve() if resumed is not None else None
    step = _run_of(resumed)[1] if resumed is not None else None
    for folder in _candidates(save):
        if resumed_at is not None and folder.resolve() == resumed_at:
            continue
        theirs, at = _run_of(folder)
        name = folder if folder != save else save / TRAINING_STATE
        if theirs is None:
            raise ValueError(f"--save {save} holds {name}, unfinished (no {MANIFEST}); pass --overwrite to remove "
                             "it, or --save another folder")
        if run is None or theirs != run:
            raise ValueError(f"--save {save} holds checkpoints of another run, {name}; pass --resume {save} to "
                             f"continue that run, --overwrite to remove them, or --save another folder")
        if folder != save and step is not None and at is not None and at > step and _verifies(folder):
            raise ValueError(f"--save {save} holds {folder.name}, newer (step {at}) than the checkpoint --resume "
                             f"continues ({resumed}, step {step}); rotation would mix the two: pass --resume {save} "
                             "to continue from the newest, or --overwrite to remove the newer ones")


def _verifies(folder: Path) -> bool:
    try:
        verify(folder)
    except Incomplete:
        return False        # a newer one that does not verify is no checkpoint: this run's own replaces it
    return True


def remove_old_checkpoints(save: str | Path, keep: Path | None, owner: int | None = None) -> None:
    """--overwrite: every checkpoint in `save` but the one resumed from (`keep`), each deleted whole (the final
    folder's weights stay; its training_state goes)."""
    save = Path(save)
    if not save.is_dir():
        return
    keep_at = keep.resolve() if keep is not None else None
    for folder in _candidates(save):
        if keep_at is not None and folder.resolve() == keep_at:
            continue
        discard(folder / TRAINING_STATE if folder == save else folder, owner)


def discard(folder: Path, owner: int | None = None) -> None:
    """Delete a folder so that no part of it is ever seen under its name: renamed to a tombstone, then removed (a
    kill leaves the tombstone, which the next run removes)."""
    if not folder.exists():
        return
    trash = folder.parent / f".sltune-trash-{owner or os.getpid()}-{folder.name}"
    _rmtree(trash)
    os.replace(folder, trash)
    fsync_dir(folder.parent)
    crash_point("discard.renamed")
    _rmtree(trash)


def drop_resume_state(path: str | Path, run: str, owner: int | None = None) -> None:
    """After the final save of a run nothing resumes (a deepspeed run: ZeRO's optimizer partitions are not in these
    checkpoints): the run's checkpoint-N folders, kept meanwhile as folders to start another run from should it
    stop, and the final folder's training_state go, leaving the Hugging Face folder alone (--model takes it)."""
    path = Path(path)
    for folder in _candidates(path):
        if folder != path and _run_of(folder)[0] == run:
            discard(folder, owner)
    discard(path / TRAINING_STATE, owner)


def prune(path: str | Path, keep: int, step: int | None = None, run: str | None = None,
          owner: int | None = None) -> None:
    """After checkpoint-{step} of `run` is complete: remove all but the newest `keep` complete checkpoints of the
    run (a manifest naming it, every file there at its size). Incomplete folders and other runs' are neither
    counted nor removed. A final folder of this run at a later step (the future a resume from an earlier
    checkpoint replaces) loses its training_state, so a later --resume cannot pick it over this run's own."""
    path = Path(path)
    complete = []
    for folder in _candidates(path):
        if folder == path:
            theirs, at = _run_of(folder)
            if run is not None and theirs == run and step is not None and at is not None and at > step:
                discard(folder / TRAINING_STATE, owner)
            continue
        manifest = _verified_quickly(folder)
        if manifest is None or (run is not None and manifest["run"] != run):
            continue
        if step is not None and int(manifest["step"]) > step:
            continue
        complete.append((int(manifest["step"]), float(manifest.get("saved_at", 0)), folder))
    complete.sort()
    for _, _, folder in complete[:max(0, len(complete) - max(keep, 1))]:
        discard(folder, owner)


def _verified_quickly(folder: Path) -> dict[str, Any] | None:
    """A checkpoint's manifest when every file it lists is there at its size (no checksums: rotation reads no file
    whole); None otherwise."""
    manifest = _manifest(folder)
    if manifest is None:
        return None
    for rel, entry in manifest["files"].items():
        try:
            if (folder / rel).stat().st_size != entry.get("size"):
                return None
        except (OSError, AttributeError):
            return None
    return manifest


def recover(root: str | Path, finish: bool = True) -> None:
    """Under `root`'s lock (taken here, or already this run's): finish or remove what a dead run left in it and in
    its checkpoint-N folders. Whatever is there is dead: its writer held the lock. A complete unit (its manifest
    written) is moved in as its save would have, when `finish` and when it is newer than what it would replace
    (_newer); every other unit, tombstone and temporary file goes. Once per hold of the lock: a run recovers at its
    start only. A FolderBusy when a live run holds the lock."""
    root = Path(root)
    if not root.is_dir():
        return
    lock = hold(root)
    try:
        held = lock.held
        if held is None or held.recovered:
            return
        held.recovered = True
        for folder in [root, *(p for p in root.iterdir() if _CHECKPOINT.match(p.name) and p.is_dir())]:
            for entry in sorted(folder.iterdir(), key=lambda p: p.name):
                _recover_one(root, folder, entry, finish)
    finally:
        lock.release()


def _recover_one(root: Path, folder: Path, entry: Path, finish: bool) -> None:
    if entry.name in _OLD_LEFTOVERS or (_TOKENIZER_TMP.match(entry.name) and entry.is_file()):
        _rmtree(entry)
        return
    m = _LEFTOVER.match(entry.name)
    if m is None:
        return
    kind, name = m.group("kind"), m.group("name") or ""
    if finish and folder == root and kind == "save" and _newer(entry, root):    # some files may be in root
        _swap_in(root, entry, os.getpid())
    elif finish and folder == root and kind == "ckpt" and _CHECKPOINT.match(name) \
            and _verified_quickly(entry) is not None and not _verifies(root / name):
        _commit_folder(entry, root / name, os.getpid())
    else:
        _rmtree(entry)


def _newer(unit: Path, root: Path) -> bool:
    """A final-folder unit is newer than the folder's current checkpoint (its manifest: a folder half moved into
    still has the old one) by its save time, then its step; a folder without a manifest holds nothing newer."""
    new, old = _manifest(unit), _manifest(root)
    if new is None:
        return False
    if old is None:
        return True
    return (float(new.get("saved_at", 0)), int(new["step"])) > (float(old.get("saved_at", 0)), int(old["step"]))


def _rmtree(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists() or path.is_symlink():
        path.unlink(missing_ok=True)
