"""The body of a trial: runs in its own process, builds the spec's backend (SpeedLoader's engine, DeepSpeed or
FSDP: sltune.backends), measures, reports, and checks the step-1 loss against plain PyTorch's (parity).

Everything it can explain becomes a result (oom with the peak, failed with the exception); only a
crash or a kill leaves the parent to explain the silence.
"""

from __future__ import annotations

import ctypes
import os
import resource
import sys
import time
import traceback
from typing import Any

import torch

from sltune.models.confined import within
from sltune.profiling.resident import resident_bytes  # noqa: F401 - the trial's own figures; tests read it here
from sltune.profiling.lifeline import exit_when_unread
from sltune.profiling.schema import TrialSpec


def main(spec_data: dict[str, Any], conn, rank: int = 0, world: int = 1, port: int | None = None,
         master: str = "127.0.0.1") -> None:
    """Entry point in a trial process: run the trial (as one rank of `world`, whose process group's store is at
    master:port), send one result dict, exit."""
    started = time.perf_counter()     # just forked: setup_s counts from here
    exit_when_unread(conn)         # the worker that waits for this result died: stop at once
    spec = TrialSpec.model_validate(spec_data)
    try:
        if world > 1:
            _join(spec, rank, world, port, master)
        with within(spec.models_dir):       # a server's job: its model folder read only inside its models_dir
            result = run(spec, rank, started)
        if world > 1:
            import torch.distributed as dist

            dist.destroy_process_group()
    except BaseException as err:  # noqa: BLE001 - everything is reported, nothing escapes silently
        result = describe_failure(err)
    result.setdefault("config", spec.knobs())
    result["rank"] = rank
    try:
        conn.send(result)
    finally:
        conn.close()


def _join(spec: TrialSpec, rank: int, world: int, port: int, master: str) -> None:
    """Join the trial's process group: gloo on the CPU, NCCL on CUDA (one GPU per rank of this node)."""
    import datetime

    import torch.distributed as dist

    here = spec.per_node                # the ranks on this node, which share its cores or hold a GPU each
    os.environ.update(MASTER_ADDR=master, MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank % here), LOCAL_WORLD_SIZE=str(here))     # DeepSpeed reads them
    backend = "gloo"
    if spec.device.startswith("cuda"):
        backend = "nccl"
        torch.cuda.set_device(rank % here)
    elif spec.cpu_threads is None:   # oversubscribed threads crawl
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // here))
    dist.init_process_group(backend, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=max(30.0, spec.timeout_s)))


def describe_failure(err: BaseException) -> dict[str, Any]:
    from sltune.runtime.memory import DeviceMemoryExceeded

    if isinstance(err, DeviceMemoryExceeded):
        return {"status": "oom", "oom_resource": "device", "error": str(err), "peak_device_bytes": err.peak_bytes}
    if isinstance(err, torch.OutOfMemoryError):
        return {"status": "oom", "oom_resource": "device", "error": f"device out of memory: {err}"}
    if isinstance(err, MemoryError):
        return {"status": "oom", "oom_resource": "host",
                "error": "host memory exhausted (MemoryError); lower num_sub_batches or sub_batch_size, or give the "
                         "trial more host memory"}
    tail = "".join(traceback.format_exception(err)[-3:]).strip()
    return {"status": "failed", "error": f"{type(err).__name__}: {err}", "traceback": tail}


def host_peak_bytes() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def forget_fork_server_heap() -> None:
    """A trial is forked from a server whose heap holds memory it freed, and inherits its resident high-water
    mark: the trial's own allocations then reuse resident pages and its peak hides what it needs. Give the
    free pages back and reset the mark (Linux) so peak_host_bytes is this trial's."""
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")            # 5: reset the peak resident set size to the current one
    except OSError:
        pass


def _give_back_freed_memory() -> None:
    """What the released backend held, back to the system (Linux): the reference then allocates anew rather than
    growing the trial's memory past what its measured steps needed."""
    import gc

    gc.collect()
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except OSError:
            pass


def run(spec: TrialSpec, rank: int = 0, started: float | None = None) -> dict[str, Any]:
    """Build the spec's backend, warm it up, time its steps, read its peaks, profile one step; then, the backend
    released, check its step-1 loss against plain PyTorch's (parity: status diverged when it is off)."""
    from sltune.backends import build
    from sltune.backends.base import TrainingSpec

    started = time.perf_counter() if started is None else started
    forget_fork_server_heap()
    torch.manual_seed(spec.seed)
    if spec.cpu_threads is not None:
        torch.set_num_threads(spec.cpu_threads)
    backend = build(spec.backend, TrainingSpec.of(spec))
    try:
        setup = {"setup_s": time.perf_counter() - started, "host_bytes_at_start": resident_bytes()}
        ran = {**spec.knobs(), "num_layers": backend.model.config.num_hidden_layers}   # the depth it ran, reported
        if spec.mode == "generate":
            return {**_run_generate(spec, backend.engine, setup), "config": ran}
        result, step_one = _run_train(spec, backend, rank, setup)
        result["config"] = ran
        vocab = backend.model.config.vocab_size
    finally:
        backend.close()
    del backend                 # the reference is built in the memory the backend held
    if rank != 0:               # rank 0 checks the loss over every rank's rows; a merged result is rank 0's
        return result
    result["parity"] = _parity(spec, step_one, vocab)
    if not result["parity"]["ok"]:
        result.update(status="diverged", error=_diverged(spec, result["parity"]))
    return result


def _diverged(spec: TrialSpec, p: dict[str, Any]) -> str:
    """Why the step-1 loss is not plain PyTorch's: the model's own (non-finite weights, an overflow), which no config
    can fix, or this config's."""
    if p.get("cause"):
        return (f"step-1 loss {p['loss']:.6g}, and plain PyTorch's on the same weights and batch "
                f"{p['reference_loss']:.6g}: {p['cause']}")
    return (f"step-1 loss {p['loss']:.6g} is not plain PyTorch's {p['reference_loss']:.6g} on the same weights and "
            f"batch: relative difference {p['rel_diff']:.3g} > tolerance {p['tolerance']:.3g} ({spec.dtype}); this "
            f"{spec.backend} config does not train the model correctly")


def _run_train(spec: TrialSpec, backend, rank: int, setup: dict[str, Any]) -> tuple[dict[str, Any], float]:
    """Training throughput, peaks and breakdown; with the first step's loss (parity's)."""
    from sltune.profiling.breakdown import profile_call
    from sltune.training.data import batches

    model = backend.model
    model.train()
    data = batches(spec.rows, spec.seq_len, model.config.vocab_size, seed=spec.seed + rank)   # each rank its own rows

    peak_device = None
    step_one = None
    for _ in range(max(spec.warmup_steps, backend.measured_steps)):      # the steps that measure device memory
        res = backend.step(next(data))
        step_one = res.loss if step_one is None else step_one
        peak_device = res.peak_device_bytes if peak_device is None else max(peak_device, res.peak_device_bytes or 0)
    last = []

    def step() -> tuple[float, int]:
        last[:] = [backend.step(next(data))]
        return last[0].seconds, last[0].tokens

    timing = {**_measure(spec, step), **setup}
    result: dict[str, Any] = {
        "status": "ok",
        **_headline(timing),
        "peak_device_bytes": peak_device,
        "peak_host_bytes": host_peak_bytes(),
        "io": last[0].io.as_dict(),
        "loss": last[0].loss,
    }
    if spec.profile:
        batch = next(data)
        trace = spec.trace_path if rank == 0 else None        # every rank profiles (collectives match)
        bd = profile_call(lambda: backend.step(batch), trace_path=trace)
        result.update(breakdown=bd.fractions, breakdown_seconds=bd.seconds, top_ops=bd.top_ops,
                      profiled_step_seconds=bd.wall_seconds, trace_path=trace)
    if backend.detail():
        result["backend_detail"] = backend.detail()
    return result, step_one


def _parity(spec: TrialSpec, loss: float, vocab: int) -> dict[str, Any]:
    """The step-1 loss (the mean over every rank's rows) against plain PyTorch's on those rows: each rank's first
    batch drawn again from its seed, as _run_train drew it."""
    from sltune.profiling.parity import parity, reference_loss
    from sltune.training.data import batches

    _give_back_freed_memory()
    rows = torch.cat([next(batches(spec.rows, spec.seq_len, vocab, seed=spec.seed + r))
                      for r in range(spec.world_size)])
    reference, allowance, cause = reference_loss(spec, rows)
    return parity(loss, reference, spec.dtype, allowance, cause)


def _measure(spec: TrialSpec, step) -> dict[str, Any]:
    from sltune.profiling.timing import measure

    return measure(step, spec.steps, spec.min_time_s, spec.max_steps, spec.remeasure)


def _headline(timing: dict[str, Any]) -> dict[str, Any]:
    """tokens_per_s is the median step's, step_seconds the median step time."""
    return {"tokens_per_s": timing.pop("tokens_per_s"), "step_seconds": timing["median_s"], "timing": timing}


def _run_generate(spec: TrialSpec, engine, setup: dict[str, Any]) -> dict[str, Any]:
    """Generation throughput: spec.rows random prompts of prompt_len tokens, new_tokens each per call.

    End-of-sequence stopping is off so every call generates the same number of tokens."""
    from sltune.training.data import batches
    from sltune.profiling.breakdown import profile_call

    model = engine.model
    prompts = batches(spec.rows, spec.prompt_len, model.config.vocab_size, seed=spec.seed)

    def call(ids):
        engine.generate(ids, max_new_tokens=spec.new_tokens, eos_token_id=[])
        return engine.last_generation

    warm = [call(next(prompts)) for _ in range(spec.warmup_steps)]   # the first call measures device memory
    peaks = [s.peak_device_bytes for s in warm if s.peak_device_bytes is not None]
    last = []

    def step() -> tuple[float, int]:
        last[:] = [call(next(prompts))]
        return last[0].seconds, last[0].new_tokens

    timing = {**_measure(spec, step), **setup}
    result: dict[str, Any] = {
        "status": "ok",
        **_headline(timing),
        "peak_device_bytes": max(peaks) if peaks else None,
        "peak_host_bytes": host_peak_bytes(),
        "io": last[0].io.as_dict(),
    }
    if spec.profile:
        ids = next(prompts)
        bd = profile_call(lambda: call(ids), trace_path=spec.trace_path)
        result.update(breakdown=bd.fractions, breakdown_seconds=bd.seconds, top_ops=bd.top_ops,
                      profiled_step_seconds=bd.wall_seconds, trace_path=spec.trace_path)
    return result
