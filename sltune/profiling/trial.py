"""run_trial: one configuration, measured in a process of its own, always answered.

Trials fork from a server process that has already imported torch and transformers (multiprocessing's
forkserver with a preload), so each starts in well under a second yet shares no memory, allocator state
or threads with the caller or with other trials. The parent waits with a wall-clock deadline and
watches the child's resident memory; a timeout, a kill, a crash or a memory overrun becomes a
TrialResult with a reason, never a hang or an exception in the caller.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from typing import Any, Callable

import psutil

from sltune.profiling.schema import TrialResult, TrialSpec
from sltune.sizes import format_bytes

# transformers imports model code lazily; preloading it here saves each trial seconds
_PRELOAD = ["sltune.profiling.preload"]
_CONTEXT: mp.context.BaseContext | None = None


def _context() -> mp.context.BaseContext:
    global _CONTEXT
    if _CONTEXT is None:
        if "forkserver" in mp.get_all_start_methods():
            _CONTEXT = mp.get_context("forkserver")
            _CONTEXT.set_forkserver_preload(_PRELOAD)
        else:
            _CONTEXT = mp.get_context("spawn")
    return _CONTEXT


def run_trial(spec: TrialSpec | dict[str, Any], stop: Callable[[], str | None] | None = None) -> TrialResult:
    """Run one trial in a child process and return what it measured, or why it has no measurement.

    `stop` is polled while the trial runs; when it returns a reason the trial is killed and reported as
    failed with "stopped: <reason>"."""
    spec = TrialSpec.model_validate(spec) if not isinstance(spec, TrialSpec) else spec
    if spec.world_size > 1:
        from sltune.profiling.distributed import run_distributed_trial

        return run_distributed_trial(spec, stop)
    from sltune.profiling import child

    ctx = _context()
    recv, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=child.main, args=(spec.model_dump(), send), daemon=True)
    start = time.monotonic()
    proc.start()
    send.close()
    outcome = _wait(proc, recv, spec, start, stop)
    _stop(proc)
    recv.close()
    outcome.setdefault("config", spec.knobs())
    outcome["wall_seconds"] = time.monotonic() - start
    outcome.pop("traceback", None)
    return TrialResult.model_validate(outcome)


def _wait(proc, recv, spec: TrialSpec, start: float, stop: Callable[[], str | None] | None) -> dict[str, Any]:
    deadline = start + spec.timeout_s
    watcher = _Watcher(proc.pid)
    last_check = 0.0
    while True:
        if stop is not None and time.monotonic() - last_check > 0.5:
            last_check = time.monotonic()
            if why := stop():
                return {"status": "failed", "error": f"stopped: {why}"}
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return {"status": "timeout",
                    "error": f"no result within timeout_s={spec.timeout_s:g}s; the trial was stopped. Use fewer "
                             "steps or a smaller config, or raise timeout_s"}
        try:
            if recv.poll(min(0.05, remaining)):
                return recv.recv()
        except (EOFError, OSError):
            pass  # the child closed the pipe without a result: it died
        if not proc.is_alive():
            try:
                if recv.poll(0):
                    return recv.recv()
            except (EOFError, OSError):
                pass
            return {"status": "failed", "error": _death(proc.exitcode)}
        if spec.host_memory_limit is not None:
            rss = watcher.rss()
            if rss > spec.host_memory_limit:
                return {"status": "oom", "peak_host_bytes": rss,
                        "error": f"host memory limit exceeded: the trial's resident memory reached "
                                 f"{format_bytes(rss)} ({rss} bytes) against host_memory_limit "
                                 f"{format_bytes(spec.host_memory_limit)}; lower num_sub_batches or sub_batch_size"}


def _death(code: int | None) -> str:
    if code is not None and code < 0:
        sig = signal.Signals(-code).name
        hint = " (killed: the host may have run out of memory)" if sig == "SIGKILL" else ""
        return f"the trial process died from {sig}{hint} before reporting a result"
    hint = ""
    if code == 1:
        hint = (" (if run_trial was called from a script, guard the script's top level with "
                "`if __name__ == '__main__':`: multiprocessing imports the main module in the trial process)")
    return f"the trial process exited with code {code} before reporting a result{hint}"


def _stop(proc) -> None:
    if proc.is_alive():
        proc.terminate()
        proc.join(2)
    if proc.is_alive():
        os.kill(proc.pid, signal.SIGKILL)
    proc.join(5)


class _Watcher:
    """Resident memory of the trial process and any processes it started."""

    def __init__(self, pid: int):
        try:
            self.proc = psutil.Process(pid)
        except psutil.Error:
            self.proc = None

    def rss(self) -> int:
        if self.proc is None:
            return 0
        try:
            procs = [self.proc, *self.proc.children(recursive=True)]
            return sum(p.memory_info().rss for p in procs)
        except psutil.Error:
            return 0
