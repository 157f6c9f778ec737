"""One unit: a checkpoint written whole into a hidden sibling, each file flushed, the manifest last, then made visible
(one rename for checkpoint-N, the files moved in for the final folder)."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import time
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist

from sltune.runtime.disk.durable import crash_point, fsync_dir
from sltune.training.checkpoints.layout import FORMAT, MANIFEST, TRAINER, TRAINING_STATE, WEIGHTS, rmtree
from sltune.training.checkpoints.manifest import Incomplete, read_manifest, record, write_manifest
from sltune.training.checkpoints.ranks import new_run_id, rank_world, together


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
    rank, world = rank_world()
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
            rmtree(staging)            # a failed save (a full disk) leaves nothing behind to keep the disk full
    return path


def _stage(root: Path, staging: Path, path: Path) -> None:
    with _writing(staging, path, root):
        root.mkdir(parents=True, exist_ok=True)
        rmtree(staging)
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
        write_manifest(staging / TRAINING_STATE, {"format": FORMAT, "step": step, "run": run, "world_size": world,
                                                   "saved_at": time.time(), "files": dict(sorted(files.items()))})
    crash_point("save.manifest")


def _publish(staging: Path, path: Path, owner: int, periodic: bool) -> None:
    if periodic:
        commit_folder(staging, path, owner)
    else:
        swap_in(path, staging, owner)


def commit_folder(staging: Path, path: Path, owner: int) -> None:
    """Make a complete checkpoint-N visible with one rename; an older folder of that name goes to a tombstone."""
    trash = None
    if path.exists():
        trash = path.parent / f".sltune-trash-{owner}-{path.name}"
        rmtree(trash)
        os.replace(path, trash)
        crash_point("commit.tombstoned")
    os.replace(staging, path)
    fsync_dir(path.parent)
    crash_point("commit.renamed")
    if trash is not None:
        rmtree(trash)


def swap_in(root: Path, unit: Path, owner: int) -> None:
    """Move a complete unit's files into the final folder, `training_state/` (with the manifest) last; the old
    layout's weight files and another tokenizer's files go. Run again on what is left after a kill, it finishes the
    move (recover). Not atomic for a reader of `root` that ignores the manifest (see the module's docstring)."""
    from sltune.models.checkpoint import INDEX, TOKENIZER_FILES

    manifest = read_manifest(unit)
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
        rmtree(trash)
        os.replace(old, trash)
        crash_point("final.tombstoned")
    os.replace(unit / TRAINING_STATE, old)
    fsync_dir(root)
    crash_point("final.committed")
    rmtree(trash)
    rmtree(unit)


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
