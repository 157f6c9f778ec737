"""A checkpoint's manifest (sltune.runtime.disk.manifest's file, this format's fields): every file of the checkpoint
with its size and checksum, the step, the run and the ranks, written last and read back; and the one error a
checkpoint that does not verify is."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sltune.runtime.disk import checksum
from sltune.runtime.disk import manifest as manifest_file
from sltune.runtime.disk.manifest import ManifestError, hash_file
from sltune.training.checkpoints.layout import TRAINING_STATE

HASH = checksum.NAME        # what a save sums its files with (sltune.runtime.disk.checksum, as the disk tier's blocks)


class Incomplete(ManifestError):
    """A checkpoint folder whose manifest does not verify: a line naming the file."""


def record(path: Path) -> dict[str, Any]:
    """A file's manifest entry, the file flushed to disk: its size and checksum, or only its size for a file
    hard-linked from the disk tier's folder (its blocks carry their own checksums; reading them here would read
    the whole optimizer state back at every checkpoint)."""
    st = path.stat()
    if st.st_nlink > 1:
        return {"size": st.st_size, "linked": True}
    return {"size": st.st_size, HASH: hash_file(path, HASH, sync=True)}


def write_manifest(folder: Path, manifest: dict[str, Any]) -> None:
    """The unit's manifest, last (sltune.runtime.disk.manifest.write), indented: a checkpoint is a folder people
    open."""
    manifest_file.write(folder, manifest, readable=True)


def read_manifest(folder: Path) -> dict[str, Any] | None:
    """A checkpoint folder's (or a unit's) manifest when it is there and reads as one: files, step, run, world
    size. None otherwise."""
    try:
        manifest = manifest_file.read(folder / TRAINING_STATE)
        if not isinstance(manifest, dict) or not isinstance(manifest["files"], dict):
            return None
        int(manifest["step"]), str(manifest["run"]), int(manifest["world_size"]), float(manifest.get("saved_at", 0))
    except (ManifestError, ValueError, KeyError, TypeError):
        return None
    return manifest
