"""One writer: the --save folder's .sltune-lock, an exclusive flock held by the run for its whole life (the kernel
drops it when the process dies)."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import socket
from pathlib import Path

from sltune.training.checkpoints.layout import LOCK


class FolderBusy(ValueError):
    """Another live process holds a folder's .sltune-lock: one line naming it and its holder."""

    def __init__(self, message: str, holder: str) -> None:
        super().__init__(message)
        self.holder = holder


class _Held:
    def __init__(self, fd: int) -> None:
        self.fd, self.refs, self.recovered = fd, 0, False


_HELD: dict[str, _Held] = {}


def _forget_locks() -> None:
    """In a forked child: the parent's locks are not the child's (flock belongs to the open file description the
    two share, so the child closes its copies and never unlocks them)."""
    for held in _HELD.values():
        with contextlib.suppress(OSError):
            os.close(held.fd)
    _HELD.clear()


os.register_at_fork(after_in_child=_forget_locks)


class FolderLock:
    """This process's hold on a folder's .sltune-lock (counted: a run holds it while it also recovers under it);
    release() is idempotent, and the kernel releases it when the process exits."""

    def __init__(self, key: str, held: _Held) -> None:
        self.key, self._held = key, held

    @property
    def held(self) -> _Held | None:
        return self._held

    def release(self) -> None:
        held, self._held = self._held, None
        if held is None or _HELD.get(self.key) is not held:
            return
        held.refs -= 1
        if held.refs == 0:
            del _HELD[self.key]
            os.close(held.fd)           # drops the flock: no other descriptor of ours shares it


def hold(folder: str | Path, flag: str = "--save") -> FolderLock:
    """Take `folder`'s .sltune-lock (made with the folder when missing) for this process: a FolderBusy naming the
    lock file and its holder's pid and host when another process holds it."""
    folder = Path(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        key = str(folder.resolve())
        held = _HELD.get(key)
        if held is None:
            fd = os.open(folder / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as err:
                holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "a process"
                os.close(fd)
                if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise FolderBusy(f"{flag} {folder}: another run is saving into it ({holder} holds "
                                     f"{folder / LOCK}); wait for it to end, or --save another folder",
                                     f"{holder} holds {folder / LOCK}") from None
                raise
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"pid {os.getpid()} on host {socket.gethostname()}\n".encode(), 0)
            held = _HELD[key] = _Held(fd)
    except FolderBusy:
        raise
    except OSError as err:
        raise OSError(err.errno or errno.EIO, f"cannot lock it for this run ({err.strerror or err}); --save a "
                      "folder on a filesystem this process can write and lock", str(folder / LOCK)) from None
    held.refs += 1
    return FolderLock(key, held)
