"""The one fork server a process forks its trials and spec checks from, starting it early, and running what needs
torch in a child of it.

The fork server preloads torch and transformers (sltune.profiling.fork_server): seconds of imports. Left
to the first trial or spec check, they come after the process's own imports of the same libraries, one
after the other (a server answered after 21 s on an idle 2-core machine). Started first thing, they run
on the other core while this process imports its own.

A `sltune tune`, `sltune worker` or API process needs torch and transformers only for a few answers: the model's
shape and what its compute allocates (sltune.tuning.cost.shape, sltune.tuning.cost.tracing), the devices here.
Their import costs such a process 5 s of CPU on 2 cores, beside the fork server's own 6 s. `call` answers them here
when this process has imported torch anyway (a trial, a test, the fork server's children), else in a child forked
from the fork server (a fork, then milliseconds), which reads model folders confined as the caller does
(sltune.models.confined), from the caller's working directory; the callers keep the answers in their caches.
"""

from __future__ import annotations

import importlib
import multiprocessing as mp
import multiprocessing.forkserver
import os
import sys
from typing import Any

from sltune.models.confined import confinement, within
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


CALL_TIMEOUT_S = 600.0  # a 1,024-layer config's shape takes seconds; a child that hangs is not waited for forever


def call(target: str, *args: Any) -> Any:
    """`module:function`(*args), here if this process has imported torch, else in a child of the fork server (args
    and result picklable; named, not passed, so that naming it imports nothing here). An exception in the child is
    raised here."""
    module, name = target.split(":")
    if "torch" in sys.modules:
        return getattr(importlib.import_module(module), name)(*args)
    ctx = context()
    recv, send = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_run, args=(module, name, args, confinement(), os.getcwd(), send), daemon=True)
    child.start()
    send.close()
    try:
        if not recv.poll(CALL_TIMEOUT_S):
            raise RuntimeError(f"{target} gave no answer in {CALL_TIMEOUT_S:g}s")
        ok, value = recv.recv()
    except EOFError:
        child.join(5)
        raise RuntimeError(f"the process running {target} died (exit code "
                           f"{child.exitcode})") from None
    finally:
        recv.close()
        if child.is_alive():
            child.kill()
        child.join()
    if not ok:
        raise value
    return value


def _run(module: str, name: str, args: tuple, models_dir: Any, cwd: str, send: Any) -> None:
    """In the child: the call, its answer or its exception sent back."""
    try:
        os.chdir(cwd)
        with within(models_dir):
            send.send((True, getattr(importlib.import_module(module), name)(*args)))
    except BaseException as err:  # noqa: BLE001 - whatever it is, the caller raises it
        try:
            send.send((False, err))
        except Exception:  # noqa: BLE001 - an exception that does not pickle: its words
            send.send((False, RuntimeError(f"{type(err).__name__}: {err}")))
    finally:
        send.close()
