"""Where a checkpoint's parts live: the folder's names, what a run leaves while it writes, the points a kill is landed
at, and the folders that are (or were meant to be) checkpoints."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from sltune.runtime.disk.manifest import NAME as MANIFEST  # noqa: F401 - in training_state/, as the others import it

TRAINING_STATE = "training_state"
TRAINER = "trainer.pt"
WEIGHTS = "weights.safetensors"
LOCK = ".sltune-lock"
FORMAT = 1
CHECKPOINT_NAME = re.compile(r"^checkpoint-(\d+)$")
# what a run leaves while it writes or deletes (the pid is the writing run's rank 0; it names, it decides nothing):
#   .sltune-save-{pid}                   the final folder's next contents
#   .sltune-ckpt-{pid}-checkpoint-{N}    a checkpoint-N being written
#   .sltune-trash-{pid}-{name}           a tombstone: a folder being deleted
#   .sltune-tmp-{pid}                    write_pretrained's own staging (engine.save_pretrained)
LEFTOVER = re.compile(r"^\.sltune-(?P<kind>save|ckpt|trash|tmp)-(?P<pid>\d+)(?:-(?P<name>.+))?$")
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


def candidates(path: Path) -> list[Path]:
    """The folders of `path` that are (or were meant to be) checkpoints: itself, when it has a training_state,
    and its checkpoint-N folders."""
    own = [path] if (path / TRAINING_STATE).exists() else []
    return own + sorted((p for p in path.iterdir() if CHECKPOINT_NAME.match(p.name) and p.is_dir()),
                        key=lambda p: int(p.name.split("-")[1]))


def rmtree(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists() or path.is_symlink():
        path.unlink(missing_ok=True)
