"""Checkpoints a job can resume from exactly: a Hugging Face folder plus `training_state/`.

    DIR/                               what transformers loads (config.json, safetensors, the run's tokenizer files)
    DIR/training_state/trainer.pt      step, data position, scheduler, loss scale, RNG, the save dtype, world size
    DIR/training_state/optimizer-rank{r}-of-{W}.pt   each rank's optimizer state (its shard when sharded)
    DIR/training_state/optimizer-rank{r}-of-{W}/     ... under optimizer_offload disk: the files of the engine's
                                                     last committed step (hard links: no second copy), a
                                                     manifest, and the optimizer's counters (optimizer.pt)
    DIR/training_state/weights.safetensors           the weights as stepped (the float32 masters), when the
                                                     folder's weights are in another dtype

`trainer.pt` is written last, into a temporary folder renamed into place, so a folder with it is complete: a
kill mid-save leaves the previous checkpoint as the newest one `latest` finds. Periodic checkpoints go to
DIR/checkpoint-{step}; the oldest beyond `keep` are removed.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

TRAINING_STATE = "training_state"
TRAINER = "trainer.pt"
WEIGHTS = "weights.safetensors"
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")


def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _barrier() -> None:
    if _rank_world()[1] > 1:
        dist.barrier()


def save_checkpoint(path: str | Path, engine, trainer: dict[str, Any], save_dtype: torch.dtype,
                    max_shard_size: int | str = "5GB", tokenizer: dict[str, bytes] | None = None) -> Path:
    """Write the model as a Hugging Face folder at `path` with the run's `tokenizer` files (read_tokenizer_files at
    its start) and the state a resume needs beside it (a collective when sharded: every rank calls it)."""
    from sltune.models.checkpoint import write_tokenizer_files

    path = Path(path)
    rank, world = _rank_world()
    state = engine.state_dict()
    engine.save_pretrained(path, dtype=save_dtype, max_shard_size=max_shard_size, state=state)
    staging = path / f".{TRAINING_STATE}.tmp"
    if rank == 0:
        write_tokenizer_files(path, tokenizer or {})      # before trainer.pt: a folder with it is complete
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
    _barrier()
    if getattr(engine, "disk", None) is not None:
        engine.disk.link_into(staging / f"optimizer-rank{rank}-of-{world}", engine.optimizer.state_dict())
    else:
        torch.save(engine.optimizer.state_dict(), staging / f"optimizer-rank{rank}-of-{world}.pt")
    _barrier()
    if rank == 0:
        stepped = {n: t for n, t in state.items() if t.is_floating_point()}
        if any(t.dtype != save_dtype for t in stepped.values()):
            from safetensors.torch import save_file

            exact = {name: t.detach().contiguous() for name, t in engine.untied(stepped).items()}
            save_file(exact, staging / WEIGHTS, metadata={"format": "pt"})
        torch.save({**trainer, "world_size": world, "save_dtype": str(save_dtype).removeprefix("torch."),
                    "scaler": engine.scaler.state_dict() if engine.scaler is not None else None,
                    "rng": torch.get_rng_state()}, staging / TRAINER)
        final = path / TRAINING_STATE
        old = path / f".{TRAINING_STATE}.old"
        shutil.rmtree(old, ignore_errors=True)
        if final.exists():
            os.replace(final, old)
        os.replace(staging, final)
        shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return path


def read_trainer(folder: Path) -> dict[str, Any] | None:
    """A checkpoint folder's trainer state, or None when it has none (or an incomplete one)."""
    file = folder / TRAINING_STATE / TRAINER
    if not file.is_file():
        return None
    try:
        return torch.load(file, weights_only=True)
    except Exception:   # noqa: BLE001 - a torn or foreign file: not a checkpoint to resume from
        return None


def latest(path: str | Path) -> tuple[Path, dict[str, Any]]:
    """The newest complete checkpoint in `path`: the folder itself or one of its checkpoint-{step} folders."""
    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"--resume {path}: no such folder; give the --save folder of the run to continue")
    found = []
    for folder in [path, *sorted(p for p in path.iterdir() if _CHECKPOINT.match(p.name))]:
        state = read_trainer(folder)
        if state is not None:
            found.append((int(state["step"]), folder, state))
    if not found:
        raise ValueError(f"--resume {path}: no checkpoint with a {TRAINING_STATE}/{TRAINER} in it or in its "
                         "checkpoint-* folders; a run writes them with --save DIR (and --save-every N)")
    step, folder, state = max(found, key=lambda f: f[0])
    return folder, state


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
        engine.optimizer.load_state_dict(torch.load(saved.with_suffix(".pt"), weights_only=True))
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


def prune(path: str | Path, keep: int) -> None:
    """Remove all but the newest `keep` checkpoint-{step} folders in `path`."""
    path = Path(path)
    folders = sorted((int(m.group(1)), p) for p in path.iterdir() if (m := _CHECKPOINT.match(p.name)))
    for _, folder in folders[:max(0, len(folders) - keep)]:
        shutil.rmtree(folder, ignore_errors=True)
