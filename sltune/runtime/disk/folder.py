"""An engine's folder under offload_dir: made and locked (`own_folder`), found dead and removed by the next engine
(`remove_stale`), and removed with its engine (`close_folder`). The disk tier (sltune.runtime.disk.state), the
weights' files (sltune.runtime.disk.weightfiles) and the gradients' spill (sltune.runtime.disk.gradwindow) share it.
"""

from __future__ import annotations

import fcntl
import itertools
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from sltune.runtime.disk.durable import crash_point

LOCK = ".lock"
STALE_S = 60.0                  # a hidden engine folder without a lock this old is a dead one's (own_folder)
_names = itertools.count()


def safe_name(name: str) -> str:
    """A unit's name as part of a file name."""
    return "".join(c if c.isalnum() else "_" for c in name)


def own_folder(root: Path, rank: int) -> tuple[Path, int]:
    """A fresh folder under root, locked by this process: made under a hidden name, locked, then renamed, so
    no other engine's cleanup sees it unlocked."""
    name = f"sltune-r{rank}-{os.getpid()}-{next(_names)}"
    staging = root / f".{name}"
    staging.mkdir()
    fd = os.open(staging / LOCK, os.O_CREAT | os.O_RDWR, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.replace(staging, root / name)
    return root / name, fd


def remove_stale(root: Path) -> None:
    """Folders of engines whose process is gone (killed: nothing removed them) hold gigabytes: remove them. A folder
    is dead when no process holds its lock; one without a lock file is being removed (a kill in close_folder leaves
    it so: the lock goes last), and a hidden one (`own_folder`'s, made before its lock) is dead once STALE_S old. So
    are writable_dir's probes that a kill left."""
    now = time.time()
    for folder in [*root.glob("sltune-r*"), *root.glob(".sltune-r*")]:
        try:
            fd = os.open(folder / LOCK, os.O_RDWR)
        except OSError:
            if folder.is_dir() and not folder.is_symlink() and (not folder.name.startswith(".")
                                                                 or _age(folder, now) > STALE_S):
                shutil.rmtree(folder, ignore_errors=True)
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)            # held: a live engine's
            continue
        shutil.rmtree(folder, ignore_errors=True)
        os.close(fd)
    for probe in root.glob(".sltune-write-probe-*"):
        if _age(probe, now) > STALE_S:
            unlink_quietly(probe)


def _age(path: Path, now: float) -> float:
    try:
        return now - path.lstat().st_mtime
    except OSError:
        return 0.0


def unlink_quietly(path: Path) -> None:
    """Remove a file that is garbage whatever happens (a folder gone read-only keeps it: the folder goes later)."""
    try:
        path.unlink(missing_ok=True)
    except OSError:
        pass


def close_folder(folder: Path, lock: int, pool: ThreadPoolExecutor) -> None:
    """The engine's folder removed, its lock file last: a kill part-way leaves a folder whose lock nobody holds,
    which the next engine removes (remove_stale)."""
    pool.shutdown(wait=True)
    try:
        entries = [p for p in folder.iterdir() if p.name != LOCK]
    except OSError:
        entries = []
    for n, entry in enumerate(entries):
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            unlink_quietly(entry)
        if n == 0:
            crash_point("engine.closing")
    shutil.rmtree(folder, ignore_errors=True)
    os.close(lock)
