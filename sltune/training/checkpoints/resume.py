"""Resuming: the newest checkpoint that verifies (a newer one that does not is skipped with a line), the same one on
every rank, and the optimizer, loss scale and RNG loaded from it."""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from sltune.training.checkpoints.layout import (CHECKPOINT_NAME, LEFTOVER, TRAINER, TRAINING_STATE, WEIGHTS,
                                                candidates)
from sltune.training.checkpoints.lock import FolderBusy
from sltune.training.checkpoints.manifest import Incomplete, read_manifest
from sltune.training.checkpoints.ranks import rank_world, together
from sltune.training.checkpoints.recover import recover
from sltune.training.checkpoints.verify import load_state, verify


def _warn(message: str) -> None:
    if os.environ.get("RANK", "0") == "0":
        print(f"sltune: warning: {message}", file=sys.stderr, flush=True)


def _order(folder: Path) -> tuple[float, float]:
    """Newest first: by the manifest's step (then its save time), else by the folder's number (the folder itself:
    the newest)."""
    manifest = read_manifest(folder)
    if manifest is not None:
        return float(manifest["step"]), float(manifest.get("saved_at", 0))
    m = CHECKPOINT_NAME.match(folder.name)
    return (float(m.group(1)) if m else float("inf")), 0.0


def _recover_to_read(path: Path) -> None:
    """Finish what a dead run left in `path` (and, for a checkpoint-N folder, beside it) before reading it, when its
    lock can be taken; a folder a live run holds (or one this process cannot lock, read-only) is read as it is:
    verification then skips what that run has not finished."""
    roots = [path]
    if CHECKPOINT_NAME.match(path.name) and any(LEFTOVER.match(p.name) for p in path.parent.iterdir()):
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
    found = sorted(candidates(path), key=_order, reverse=True)
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
    rank, world = rank_world()
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
    rank, world = rank_world()
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
            getattr(engine, "load_optimizer_state", engine.optimizer.load_state_dict)(load_state(file))
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
    from sltune.runtime.disk.files import read_committed

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
