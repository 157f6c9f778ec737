"""Verified: a checkpoint's manifest, its parts, their step and run, every checksum, and the disk tier's hard-linked
blocks against their own manifest."""

from __future__ import annotations

from pathlib import Path, PurePosixPath
from typing import Any

import torch

from sltune.runtime.disk.manifest import hash_file, member
from sltune.training.checkpoints.layout import MANIFEST, TRAINER, TRAINING_STATE
from sltune.training.checkpoints.manifest import Incomplete, read_manifest


def load_state(file: Path) -> Any:
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
    manifest = read_manifest(folder)
    if manifest is None:
        raise Incomplete(f"{mfile}: not a checkpoint manifest (unreadable, or without its files, step, run or "
                         "world size)")
    files: dict[str, dict[str, Any]] = manifest["files"]
    step, run, world = int(manifest["step"]), str(manifest["run"]), int(manifest["world_size"])
    for rel, entry in files.items():
        file = member(folder, rel, Incomplete, nested=True, listed_in=mfile)
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
    trainer = load_state(state / TRAINER)
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
    can still pick an older checkpoint, not an error when the engine adopts it; sltune.runtime.disk.state remembers
    the blocks found whole, so adopting them reads none again."""
    from sltune.runtime.disk.files import IntegrityError, check_files

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


def verifies(folder: Path) -> bool:
    try:
        verify(folder)
    except Incomplete:
        return False        # a newer one that does not verify is no checkpoint: this run's own replaces it
    return True


def verified_quickly(folder: Path) -> dict[str, Any] | None:
    """A checkpoint's manifest when every file it lists is there at its size (no checksums: rotation reads no file
    whole); None otherwise."""
    manifest = read_manifest(folder)
    if manifest is None:
        return None
    for rel, entry in manifest["files"].items():
        try:
            if (folder / rel).stat().st_size != entry.get("size"):
                return None
        except (OSError, AttributeError):
            return None
    return manifest
