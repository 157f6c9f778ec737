"""The one fork server a process forks its trials and spec checks from, and starting it early.

The fork server preloads torch and transformers (sltune.profiling.fork_server): seconds of imports. Left
to the first trial or spec check, they come after the process's own imports of the same libraries, one
after the other (a server answered after 21 s on an idle 2-core machine). Started first thing, they run
on the other core while this process imports its own.
"""

from __future__ import annotations

import multiprocessing as mp
import multiprocessing.forkserver

from sltune.profiling.lifeline import fork_server_dies_with_me

PRELOAD = ["sltune.profiling.fork_server"]      # transformers imports model code lazily: load it once there
_CONTEXT: mp.context.BaseContext | None = None


def context() -> mp.context.BaseContext:
    """multiprocessing's forkserver context with sltune's preload (spawn where there is no fork server)."""
    global _CONTEXT
    if _CONTEXT is None:
        if "forkserver" in mp.get_all_start_methods():
            _CONTEXT = mp.get_context("forkserver")
            _CONTEXT.set_forkserver_preload(PRELOAD)
            fork_server_dies_with_me()
        else:
            _CONTEXT = mp.get_context("spawn")
    return _CONTEXT


def start() -> None:
    """Start the fork server now; it imports in its own process while this one goes on."""
    if context().get_start_method() == "forkserver":
        multiprocessing.forkserver.ensure_running()
