"""manifest.json, the one file that says a folder is complete, for both formats that keep one: a checkpoint's
(sltune.training.checkpoints: every file with its size and checksum) and the disk tier's (sltune.runtime.disk.state:
the blocks of the committed version and their sections' sums). Each keeps its own fields; what they share is here:
the file's name, one writer (written last and atomically: a new one renamed over the old, flushed with its folder),
one reader, the check that a file it names is its folder's, a file's checksum (sltune.runtime.disk.checksum), and
one error type that names the file."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from sltune.runtime.disk import checksum
from sltune.runtime.disk.durable import replace_durably

NAME = "manifest.json"
TMP = f".{NAME}.tmp"        # the new manifest before its rename


class ManifestError(ValueError):
    """A folder's files or their manifest are not what was written: one line naming the file (each format's error is
    one of these: a checkpoint's Incomplete, the disk tier's IntegrityError)."""


def write(folder: Path, manifest: dict[str, Any], readable: bool = False) -> None:
    """manifest.json replaced atomically and flushed with its folder: from here on the folder holds what it names
    (`readable`: indented, for a folder people open)."""
    replace_durably(folder / NAME, json.dumps(manifest, indent=1 if readable else None).encode(), tmp=folder / TMP)


def read(folder: Path, error: type[ManifestError] = ManifestError) -> Any:
    """The manifest's JSON value, as it is (each format checks its own fields); a missing or unreadable file, or one
    that is not JSON, is an `error` naming it (a missing one's cause is the FileNotFoundError)."""
    path = folder / NAME
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        why = err.strerror if isinstance(err, OSError) else "not UTF-8 text"
        raise error(f"{path}: unreadable ({why})") from err
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise error(f"{path}: not valid JSON ({err}); the manifest is damaged") from None


def member(folder: Path, name: Any, error: type[ManifestError] = ManifestError, nested: bool = False,
           listed_in: Path | None = None) -> Path:
    """A file the manifest names, which must be `folder`'s (the manifest's own, unless `listed_in` names the manifest):
    a relative name without `..` (`nested`: in a subfolder too, else a plain name), and not a symlink pointing out of
    the folder; else an `error`."""
    parts = Path(name).parts if isinstance(name, str) else ()
    if (not parts or "\0" in name or os.path.isabs(name) or ".." in parts or (not nested and len(parts) > 1)):
        raise error(f"{listed_in or folder / NAME}: names the file {name!r}, which is not a file of its own folder "
                    "(a manifest names only the files of its folder); the manifest is damaged or forged")
    path = folder / name
    if path.is_symlink():
        target, home = path.resolve(), folder.resolve()
        if not (target.is_relative_to(home) if nested else target.parent == home):
            raise error(f"{path}: a symlink pointing out of its folder (to {target}); the files a manifest names must "
                        "be in its folder")
    return path


def hash_file(path: Path, algo: str, sync: bool = False) -> str | None:
    """The file's checksum by `algo` (None when that algorithm is not installed here); `sync` also flushes the
    file to disk, as it is read."""
    h = checksum.streaming(algo)
    if h is None:
        return None
    with open(path, "rb") as f:
        checksum.feed(h, f)
        if sync:
            os.fsync(f.fileno())
    return h.hexdigest()
