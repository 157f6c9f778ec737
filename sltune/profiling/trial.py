"""run_trial: one configuration, measured in processes of its own, always answered.

Trials fork from a server process that has already imported torch and transformers (multiprocessing's
forkserver with a preload), so each starts in well under a second yet shares no memory, allocator state
or threads with the caller or with other trials. A trial with world_size W is W such processes joined by
torch.distributed (gloo on the CPU, NCCL on CUDA). The parent waits with a wall-clock deadline and
watches every process's resident memory; a timeout, a kill, a crash, a memory overrun or one rank dying
becomes a TrialResult with a reason, never a hang or an exception in the caller.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from typing import Any, Callable

import psutil

from sltune.backends import deepspeed_ops
from sltune.loopback import free_port
from sltune.profiling import forks
from sltune.profiling.schema import TrialResult, TrialSpec
from sltune.sizes import format_bytes

StopFn = Callable[[], str | None]
MEASURED = ("ok", "diverged")       # a rank's result with figures to merge (diverged: measured, but not correct)


def run_trial(spec: TrialSpec | dict[str, Any], stop: StopFn | None = None) -> TrialResult:
    """Run one trial in child processes and return what it measured, or why it has no measurement.

    `stop` is polled while the trial runs; when it returns a reason the trial is killed and reported as
    failed with "stopped: <reason>"."""
    spec = TrialSpec.model_validate(spec) if not isinstance(spec, TrialSpec) else spec
    not_ready = ops_not_ready(spec)
    if not_ready:
        return TrialResult.model_validate({"status": "failed", "error": not_ready, "config": spec.knobs(),
                                           "wall_seconds": 0.0})
    start = time.monotonic()
    world = spec.world_size
    outcome = run_ranks(spec, range(world), free_port() if world > 1 else None, stop=stop)
    return finished(spec, merge(outcome) if isinstance(outcome, list) else outcome, start)


def run_ranks(spec: TrialSpec, ranks: range, port: int | None, master: str = "127.0.0.1",
              stop: StopFn | None = None) -> list[dict[str, Any]] | dict[str, Any]:
    """These ranks of the trial (every one, or one node's share of a trial over several: sltune.executors) forked
    here from the fork server and waited for, their process group's store at master:port: each rank's result in
    rank order, or the first reason there is none. The trial's memory on this machine, all these ranks' together,
    is the first one's peak_host_bytes when it is more than that rank's own."""
    ctx = forks.context()
    procs = []
    start = time.monotonic()
    for rank in ranks:
        recv, send = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_rank, args=(spec.model_dump(), send, rank, spec.world_size, port, master),
                           daemon=True)
        proc.start()
        send.close()
        procs.append((proc, recv))
    try:
        return _wait(procs, ranks, spec, start, stop)
    finally:
        for proc, recv in procs:
            _stop(proc)
            recv.close()


def finished(spec: TrialSpec, outcome: dict[str, Any], start: float) -> TrialResult:
    """The trial's result from its merged ranks' (or its failure), timed from `start`."""
    outcome.setdefault("config", spec.knobs())
    outcome["wall_seconds"] = time.monotonic() - start
    outcome.pop("traceback", None)
    outcome.pop("rank", None)
    return TrialResult.model_validate(outcome)


def _rank(*args: Any) -> None:
    """A trial process's entry (sltune.profiling.child.main), named here so that the caller imports neither it nor
    torch: the fork server has both loaded, the caller may have neither (a tune or worker process)."""
    from sltune.profiling import child

    child.main(*args)


def ops_not_ready(spec: TrialSpec) -> str | None:
    """Why a DeepSpeed trial cannot start with the ops it loads compiled (a trial never compiles: they are built
    here first, outside its clock and its timeout, saying so on stderr), or None."""
    if spec.backend != "deepspeed":
        return None
    accelerator = deepspeed_ops.accelerator_of(spec.device)
    ops = deepspeed_ops.needed(accelerator, spec.offload_optimizer, spec.offload_param, spec.optimizer.name)
    return deepspeed_ops.prepare(ops, accelerator, say=lambda line: print(f"sltune: {line}", file=sys.stderr,
                                                                            flush=True))


def _wait(ranks, numbers: range, spec: TrialSpec, start: float,
          stop: StopFn | None) -> list[dict[str, Any]] | dict[str, Any]:
    """Every rank's result in rank order, or the first reason there is none."""
    deadline = start + spec.timeout_s
    watchers = [_Watcher(proc.pid) for proc, _ in ranks]
    together = _Together(watchers) if len(ranks) > 1 else None
    results: dict[int, dict[str, Any]] = {}
    last_check = 0.0
    world = spec.world_size
    while True:
        for r, (proc, recv) in enumerate(ranks):
            if r in results:
                continue
            got = _poll(recv, 0.05 / len(ranks))
            if got is not None:
                results[r] = got
                if got["status"] not in MEASURED:
                    return _from_rank(got, r, ranks, numbers, world)
            elif not proc.is_alive():
                got = _poll(recv, 0)
                if got is not None:
                    results[r] = got
                    if got["status"] not in MEASURED:
                        return _from_rank(got, r, ranks, numbers, world)
                    continue
                who = "the trial process" if world == 1 else f"rank {numbers[r]} of {world}"
                peak = max([w.peak for w in watchers] + [together.peak if together is not None else 0])
                if proc.exitcode == -signal.SIGKILL and peak > 0.5 * psutil.virtual_memory().total:
                    # the kernel's out-of-memory killer: a host memory overrun, not a crash
                    return {"status": "oom", "peak_host_bytes": peak, "oom_resource": "host",
                            "error": f"{who} was killed after its resident memory reached {format_bytes(peak)}, "
                                     "most of this machine's memory: the host ran out of memory. Lower "
                                     "num_sub_batches or sub_batch_size, or set host_memory_limit"}
                return {"status": "failed", "error": _death(who, proc.exitcode)}
        if len(results) == len(ranks):
            ordered = [results[r] for r in range(len(ranks))]
            if together is not None:     # the trial's figure is all its ranks' memory together
                ordered[0]["peak_host_bytes"] = max(together.peak, ordered[0].get("peak_host_bytes") or 0)
            return ordered
        if stop is not None and time.monotonic() - last_check > 0.5:
            last_check = time.monotonic()
            if why := stop():
                return {"status": "failed", "error": f"stopped: {why}"}
        if time.monotonic() >= deadline:
            return {"status": "timeout",
                    "error": f"no result within timeout_s={spec.timeout_s:g}s; the trial was stopped. Use fewer "
                             "steps or a smaller config, or raise timeout_s"}
        if together is not None:
            total = together.pss()
            if spec.host_memory_limit is not None and total > spec.host_memory_limit:
                return {"status": "oom", "peak_host_bytes": total, "oom_resource": "host",
                        "error": f"host memory limit exceeded: the trial's {len(ranks)} ranks together held "
                                 f"{format_bytes(total)} ({total} bytes, proportional set size) against "
                                 f"host_memory_limit {format_bytes(spec.host_memory_limit)} "
                                 f"({spec.host_memory_limit} bytes), which is for the whole trial; lower "
                                 "num_sub_batches or sub_batch_size"}
            continue
        for r, w in enumerate(watchers):
            rss = w.rss()
            if spec.host_memory_limit is not None and rss > spec.host_memory_limit:
                who = "the trial's" if len(ranks) == 1 else f"rank {r}'s"
                return {"status": "oom", "peak_host_bytes": rss, "oom_resource": "host",
                        "error": f"host memory limit exceeded: {who} resident memory reached "
                                 f"{format_bytes(rss)} ({rss} bytes) against host_memory_limit "
                                 f"{format_bytes(spec.host_memory_limit)}; lower num_sub_batches or sub_batch_size"}


def _poll(recv, timeout: float) -> dict[str, Any] | None:
    try:
        if recv.poll(timeout):
            return recv.recv()
    except (EOFError, OSError):
        pass  # closed without a result: the process died
    return None


def _from_rank(result: dict[str, Any], rank: int, ranks, numbers: range, world: int) -> dict[str, Any]:
    """A rank's failure; when a peer died, the peer's death is the cause and this rank's error (a broken
    connection, typically) the consequence, so give both in that order."""
    if world == 1:
        return result
    error = f"rank {numbers[rank]} of {world}: {result.get('error')}"
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline:
        dead = [(r, p.exitcode) for r, (p, _) in enumerate(ranks) if r != rank and p.exitcode not in (None, 0)]
        if dead:
            r, code = dead[0]
            return {**result, "status": "failed",
                    "error": f"{_death(f'rank {numbers[r]} of {world}', code)}; then {error}"}
        if all(p.exitcode is not None for r, (p, _) in enumerate(ranks) if r != rank):
            break
        time.sleep(0.05)
    return {**result, "error": error}


def merge(results: list[dict[str, Any]]) -> dict[str, Any]:
    """One result for all ranks: the slowest rank's throughput and timing, the largest peaks, every rank's figures;
    the breakdown and trace are rank 0's (every rank runs the same schedule)."""
    if len(results) == 1:
        return results[0]
    slowest = min(results, key=lambda r: r["tokens_per_s"])
    out = dict(results[0])
    for key in ("tokens_per_s", "step_seconds", "timing"):
        out[key] = slowest.get(key)
    for key in ("peak_device_bytes", "peak_host_bytes"):
        values = [r.get(key) for r in results if r.get(key) is not None]
        out[key] = max(values) if values else None
    out["ranks"] = [{"rank": r.get("rank", i), **{k: r.get(k) for k in ("tokens_per_s", "step_seconds",
                                                                        "peak_device_bytes", "peak_host_bytes")}}
                    for i, r in enumerate(results)]
    return out


def _death(who: str, code: int | None) -> str:
    if code is not None and code < 0:
        sig = signal.Signals(-code).name
        hint = " (killed: the host may have run out of memory)" if sig == "SIGKILL" else ""
        return f"{who} died from {sig}{hint} before reporting a result"
    hint = ""
    if code == 1:
        hint = (" (if run_trial was called from a script, guard the script's top level with "
                "`if __name__ == '__main__':`: multiprocessing imports the main module in the trial process)")
    return f"{who} exited with code {code} before reporting a result{hint}"


def _stop(proc) -> None:
    if proc.is_alive():
        proc.terminate()
        proc.join(2)
    if proc.is_alive():
        os.kill(proc.pid, signal.SIGKILL)
    proc.join(5)


class _Together:
    """A multi-rank trial's memory, all ranks together: the sum of their proportional set sizes (PSS: a page
    the ranks share, such as the libraries they inherit from the fork server, counts once among its sharers,
    where a sum of resident sizes would count it once per rank), and the most it has been."""

    def __init__(self, watchers: list["_Watcher"]):
        self.watchers = watchers
        self.peak = 0

    def pss(self) -> int:
        total = sum(w.pss() for w in self.watchers)
        self.peak = max(self.peak, total)
        return total


class _Watcher:
    """Resident memory of a trial process and any processes it started, and the most it has been."""

    def __init__(self, pid: int):
        self.peak = 0
        try:
            self.proc = psutil.Process(pid)
        except psutil.Error:
            self.proc = None

    def pss(self) -> int:
        """The proportional set size of the process and its children (Linux; their RSS elsewhere)."""
        if self.proc is None:
            return 0
        try:
            procs = [self.proc, *self.proc.children(recursive=True)]
        except psutil.Error:
            return 0
        total = 0
        for p in procs:
            try:
                with open(f"/proc/{p.pid}/smaps_rollup", "rb") as f:
                    total += next(int(line.split()[1]) * 1024 for line in f if line.startswith(b"Pss:"))
            except (OSError, StopIteration, ValueError):
                try:
                    total += p.memory_info().rss
                except psutil.Error:
                    pass
        return total

    def rss(self) -> int:
        if self.proc is None:
            return 0
        try:
            procs = [self.proc, *self.proc.children(recursive=True)]
            rss = sum(p.memory_info().rss for p in procs)
        except psutil.Error:
            return 0
        self.peak = max(self.peak, rss)
        return rss
