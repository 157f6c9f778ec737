"""What a dead run left, finished or removed under the folder's lock; whose the --save folder's checkpoints are;
deleting whole, and rotation."""

from __future__ import annotations

import os
import re
from pathlib import Path

from sltune.runtime.disk.durable import crash_point, fsync_dir
from sltune.training.checkpoints.layout import (CHECKPOINT_NAME, LEFTOVER, MANIFEST, TRAINING_STATE, candidates,
                                                rmtree)
from sltune.training.checkpoints.lock import FolderBusy, hold
from sltune.training.checkpoints.manifest import read_manifest
from sltune.training.checkpoints.save import commit_folder, swap_in
from sltune.training.checkpoints.verify import verified_quickly, verifies

_TOKENIZER_TMP = re.compile(r"^\..+\.sltune-tmp-(?P<pid>\d+)$")     # write_tokenizer_files' temporary files
_OLD_LEFTOVERS = (".training_state.tmp", ".training_state.old")      # what sltune before manifests left


def _run_of(folder: Path) -> tuple[str | None, int | None]:
    """The run and step a checkpoint folder's manifest names (None, None without a readable one)."""
    manifest = read_manifest(folder)
    return (str(manifest["run"]), int(manifest["step"])) if manifest is not None else (None, None)


def _complete_units(root: Path) -> list[Path]:
    """The units a dead run left complete (their manifest written) in `root`."""
    return sorted(p for p in root.iterdir() if (m := LEFTOVER.match(p.name)) and m.group("kind") in ("save", "ckpt")
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
    for folder in candidates(save):
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
        if folder != save and step is not None and at is not None and at > step and verifies(folder):
            raise ValueError(f"--save {save} holds {folder.name}, newer (step {at}) than the checkpoint --resume "
                             f"continues ({resumed}, step {step}); rotation would mix the two: pass --resume {save} "
                             "to continue from the newest, or --overwrite to remove the newer ones")


def remove_old_checkpoints(save: str | Path, keep: Path | None, owner: int | None = None) -> None:
    """--overwrite: every checkpoint in `save` but the one resumed from (`keep`), each deleted whole (the final
    folder's weights stay; its training_state goes)."""
    save = Path(save)
    if not save.is_dir():
        return
    keep_at = keep.resolve() if keep is not None else None
    for folder in candidates(save):
        if keep_at is not None and folder.resolve() == keep_at:
            continue
        discard(folder / TRAINING_STATE if folder == save else folder, owner)


def discard(folder: Path, owner: int | None = None) -> None:
    """Delete a folder so that no part of it is ever seen under its name: renamed to a tombstone, then removed (a
    kill leaves the tombstone, which the next run removes)."""
    if not folder.exists():
        return
    trash = folder.parent / f".sltune-trash-{owner or os.getpid()}-{folder.name}"
    rmtree(trash)
    os.replace(folder, trash)
    fsync_dir(folder.parent)
    crash_point("discard.renamed")
    rmtree(trash)


def drop_resume_state(path: str | Path, run: str, owner: int | None = None) -> None:
    """After the final save of a run nothing resumes (a deepspeed run: ZeRO's optimizer partitions are not in these
    checkpoints): the run's checkpoint-N folders, kept meanwhile as folders to start another run from should it
    stop, and the final folder's training_state go, leaving the Hugging Face folder alone (--model takes it)."""
    path = Path(path)
    for folder in candidates(path):
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
    for folder in candidates(path):
        if folder == path:
            theirs, at = _run_of(folder)
            if run is not None and theirs == run and step is not None and at is not None and at > step:
                discard(folder / TRAINING_STATE, owner)
            continue
        manifest = verified_quickly(folder)
        if manifest is None or (run is not None and manifest["run"] != run):
            continue
        if step is not None and int(manifest["step"]) > step:
            continue
        complete.append((int(manifest["step"]), float(manifest.get("saved_at", 0)), folder))
    complete.sort()
    for _, _, folder in complete[:max(0, len(complete) - max(keep, 1))]:
        discard(folder, owner)


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
        for folder in [root, *(p for p in root.iterdir() if CHECKPOINT_NAME.match(p.name) and p.is_dir())]:
            for entry in sorted(folder.iterdir(), key=lambda p: p.name):
                _recover_one(root, folder, entry, finish)
    finally:
        lock.release()


def _recover_one(root: Path, folder: Path, entry: Path, finish: bool) -> None:
    if entry.name in _OLD_LEFTOVERS or (_TOKENIZER_TMP.match(entry.name) and entry.is_file()):
        rmtree(entry)
        return
    m = LEFTOVER.match(entry.name)
    if m is None:
        return
    kind, name = m.group("kind"), m.group("name") or ""
    if finish and folder == root and kind == "save" and _newer(entry, root):    # some files may be in root
        swap_in(root, entry, os.getpid())
    elif finish and folder == root and kind == "ckpt" and CHECKPOINT_NAME.match(name) \
            and verified_quickly(entry) is not None and not verifies(root / name):
        commit_folder(entry, root / name, os.getpid())
    else:
        rmtree(entry)


def _newer(unit: Path, root: Path) -> bool:
    """A final-folder unit is newer than the folder's current checkpoint (its manifest: a folder half moved into
    still has the old one) by its save time, then its step; a folder without a manifest holds nothing newer."""
    new, old = read_manifest(unit), read_manifest(root)
    if new is None:
        return False
    if old is None:
        return True
    return (float(new.get("saved_at", 0)), int(new["step"])) > (float(old.get("saved_at", 0)), int(old["step"]))
