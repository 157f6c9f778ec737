"""A test's code in a forked child, for kills: the child is SIGKILLed mid-run (a crash point, an outside kill) and
the parent sees how it ended. Forked, not spawned: the child shares the parent's imports (seconds saved per child)."""

from __future__ import annotations

import gc
import os
import signal
from typing import Any, Callable

import torch

from sltune.runtime.disk import durable


def in_child(fn: Callable[[], Any], crash: str | None = None, kill: Callable[[], None] | None = None) -> str:
    """fn() in a forked child: 'killed' (SIGKILL), 'done' (or 'done <what fn returned>' when it returns something),
    or 'error: <Type>: <the one line `sltune` would print>'. `crash`: the child's SLTUNE_CRASH_AT (a named point of
    sltune.runtime.disk.durable); `kill()`: installed in the child first (a hook that SIGKILLs it at some moment)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:                                         # pragma: no cover - the child
        gc.freeze()         # this process's garbage (engines of tests before) is never finalized in the child
        try:
            os.close(r)
            torch.set_num_threads(1)
            if crash:
                os.environ[durable.CRASH_ENV] = crash
            if kill is not None:
                kill()
            result = fn()
            message = "done" if result is None else f"done {result}"
        except BaseException as err:   # noqa: BLE001 - reported to the parent
            from sltune.cli.main import error_line

            message = f"error: {type(err).__name__}: {error_line(err)}"
        os.write(w, message.encode()[:8000])
        os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        said = f.read().decode()
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        assert os.WTERMSIG(status) == signal.SIGKILL, status
        return "killed"
    return said
