"""A server's model folders read only inside its models_dir, checked as each file is opened.

POST /tune resolves model.path inside models_dir when the job is submitted (sltune.service.validation), but the
folder is read later: by the worker (the spec's checks, the model's shape), by each trial (config, index, shards)
and by an export (the config). Whoever can write in models_dir meanwhile can swap the folder, or one file of it, for
a symlink leading out. So the job records the models_dir it was admitted under (`admission`, in its limits), and
the processes that read its folder run `within(models_dir)`: every file sltune.models reads from a model folder then
comes through `read_bytes` or `opened`, which check it where it is opened.

How: the name is opened with O_PATH, which resolves it (symlinks followed) and pins the inode it leads to without
opening the file itself (no FIFO blocks, no device is opened, no byte is read, no atime moves); the real path of
that descriptor (/proc/self/fd) is compared with the resolved models_dir while the descriptor holds the inode; only
then is the file opened, through the descriptor (/proc/self/fd/N re-opens the inode held, never the name again),
and a library that wants a path (safetensors maps the file itself) is handed that magic path. The alternative,
openat with O_NOFOLLOW component by component, refuses every symlink, while submission admits the ones that stay
inside models_dir (a Hugging Face cache's snapshot links to its blobs): the two checks would disagree on the same
folder. openat2's RESOLVE_BENEATH would do the walk in the kernel but is not in Python's os module. The cost is an
extra open and a readlink per file: a 600-byte config.json read in 36 us instead of 16 (this machine), once per
file a trial or a check opens, against the milliseconds to seconds reading its shards takes.

Outside `within` (`sltune tune`, `train` and `plan` on the user's own folders) files are read as named.
"""

from __future__ import annotations

import contextlib
import contextvars
import errno
import os
import stat
from pathlib import Path
from typing import Any, Iterator

_ROOT: contextvars.ContextVar[Path | None] = contextvars.ContextVar("sltune_models_dir", default=None)
LIMIT = "model.path"        # the job's limits entry that records the confinement


class OutsideModelsDir(Exception):
    """A file of a model folder now leads outside the models_dir the job was admitted under: one line. Not an
    OSError or a ValueError, so no reader's handling of a missing or malformed file (nor pydantic's of a validator's
    ValueError) turns it into another message."""


def admission(requested: str, folder: Path, root: Path) -> dict[str, Any]:
    """The limits entry a server records for a job naming model.path: the path as asked, the folder it resolved
    to, and the models_dir every later read of it is confined to."""
    return {"requested": requested, "applied": str(folder), "by": "server", "models_dir": str(root)}


def admitted_under(limits: dict[str, Any] | None) -> str | None:
    """The models_dir a job's model.path was admitted under (None: a job of `sltune tune`, or no model.path)."""
    entry = (limits or {}).get(LIMIT)
    return entry.get("models_dir") if isinstance(entry, dict) else None


@contextlib.contextmanager
def within(models_dir: str | Path | None) -> Iterator[None]:
    """Model folders read in this block (this thread, and what it calls) are read only inside `models_dir`; None
    leaves reads as they are."""
    token = _ROOT.set(Path(models_dir).resolve() if models_dir is not None else None)
    try:
        yield
    finally:
        _ROOT.reset(token)


def confinement() -> Path | None:
    """The models_dir reads are confined to here, if any."""
    return _ROOT.get()


def read_bytes(path: str | Path) -> bytes:
    """The file's bytes, the file checked inside the confinement (if any) as it is opened."""
    root = _ROOT.get()
    if root is None:
        return Path(path).read_bytes()
    held = _hold(Path(path), root)
    try:
        with open(f"/proc/self/fd/{held}", "rb") as f:
            return f.read()
    finally:
        os.close(held)


@contextlib.contextmanager
def opened(path: str | Path) -> Iterator[str]:
    """A name to open the file by (safetensors maps it itself) that leads to the file checked inside the
    confinement, held for the block: /proc/self/fd/N under a confinement, else the path as given."""
    root = _ROOT.get()
    if root is None:
        yield str(path)
        return
    held = _hold(Path(path), root)
    try:
        yield f"/proc/self/fd/{held}"
    finally:
        os.close(held)


def _hold(path: Path, root: Path) -> int:
    """An O_PATH descriptor of the regular file `path` leads to, inside `root`; OutsideModelsDir when it lies
    outside. A file that is missing or unreadable is the OSError opening it raises, as an unconfined read's."""
    fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
    try:
        real = Path(os.readlink(f"/proc/self/fd/{fd}"))
        if not real.is_relative_to(root):
            raise OutsideModelsDir(
                f"the model folder's {_role(path)} now leads outside this server's models_dir (a symlink, in the "
                "folder or on the way to it, changed after the job was submitted); the server reads no file outside "
                "models_dir: put the model folder back inside it and submit the job again")
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file (a folder, a FIFO or a device)", str(path))
    except BaseException:
        os.close(fd)
        raise
    return fd


def _role(path: Path) -> str:
    """The file by its name in the folder, never by where it leads (which is not the requester's business)."""
    return path.name or "folder"
