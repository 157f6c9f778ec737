"""Host optimizer step throughput at ~100M float32 parameters: torch's AdamW(fused=True) on the CPU, torch's
AdamW(foreach=True) and DeepSpeed's DeepSpeedCPUAdam (adamw_mode=True), side by side.

    python bench/optimizer.py [--model llama-medium] [--untied] [--steps 4] [--warmup 1] [--rounds 7]

The parameters are the tensors of a transformer, float32: --model's preset shapes (default llama-medium: hidden
768, 12 layers, vocab 32000; embedding, per-layer q/k/v/o, gate/up/down, two norms, final norm), input and
output embeddings tied (~110M parameters; --untied adds lm_head: ~134M). Weights start from one seeded snapshot
(norms 1, the rest N(0, 0.02)); the gradients are random and fixed. All three use lr 1e-5, betas (0.9, 0.999),
eps 1e-8, weight decay 0.01; before timing, each takes one step from the snapshot and its weights are compared
with fused AdamW's (the max relative difference is printed; beyond 1e-6 it is flagged and the timings still
print), so the comparison is of equal work.

A round of one optimizer: the snapshot copied into the parameters, a fresh optimizer, --warmup untimed steps (the
first allocates its state), then --steps timed steps; its state is freed before the next, so one optimizer's
state is alive at a time (~2.2 GB at 110M parameters: weights, gradients, snapshot, two moments). Rounds are
interleaved A B C A B C ... in this process; each figure is the median step time over all timed steps with its
min and max. The target, fused >= 0.9x DeepSpeedCPUAdam's step throughput, is the median over rounds of each
round's ratio with its 95% bootstrap interval (sltune.profiling.stats.paired_ratio_ci): "met" when the interval
lies above it, "not met" below it, else "within the noise".

DeepSpeed is an optional extra (pip install --no-build-isolation 'deepspeed>=0.19'); its cpu_adam op is built
with g++/ninja on first use (minutes; cached under ~/.cache/torch_extensions). If DeepSpeed is missing or its
op does not build, the bench says what failed and reports the two torch optimizers.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import os
import statistics
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Callable

import sltune  # noqa: F401  (first: sets OMP_WAIT_POLICY before torch loads, as sltune's runtime runs)
import torch

from sltune.models import load_config
from sltune.profiling.stats import paired_ratio_ci

sys.path.insert(0, str(Path(__file__).resolve().parent))
from runtime import MIN_ROUNDS  # noqa: E402

HP = dict(lr=1e-5, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
FUSED, FOREACH, DS = "AdamW fused", "AdamW foreach", "DeepSpeedCPUAdam"
TARGET = 0.9            # fused >= 0.9x DeepSpeedCPUAdam's step throughput
RTOL = 1e-6             # updated weights, max |a - b| / max |a| per tensor: a few float32 ulps

Factory = Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]


def param_shapes(model: str, tied: bool) -> list[tuple[str, torch.Size]]:
    """(name, shape) of every distinct parameter of the preset's causal LM, built on the meta device."""
    from transformers import AutoModelForCausalLM

    config = load_config(model)
    config.tie_word_embeddings = tied
    with torch.device("meta"):
        m = AutoModelForCausalLM.from_config(config)
    return [(name, p.shape) for name, p in m.named_parameters()]      # a tied weight is listed once


def tensors(shapes, seed: int = 0) -> tuple[list[torch.nn.Parameter], list[torch.Tensor]]:
    """The parameters, their gradients set (random, fixed) and a snapshot of their starting weights."""
    gen = torch.Generator().manual_seed(seed)
    snapshot = [torch.ones(s) if len(s) == 1 else torch.empty(s).normal_(0, 0.02, generator=gen) for _, s in shapes]
    params = [torch.nn.Parameter(w.clone()) for w in snapshot]
    for p in params:
        p.grad = torch.empty_like(p).normal_(0, 1e-3, generator=gen)
    return params, snapshot


def reset(params: list[torch.nn.Parameter], snapshot: list[torch.Tensor]) -> None:
    with torch.no_grad():
        for p, w in zip(params, snapshot):
            p.copy_(w)


def deepspeed_adam() -> tuple[Factory | None, str]:
    """DeepSpeedCPUAdam with its op built and loaded, or None and what failed. Imports DeepSpeed as bench/peers.py
    does: on its CPU accelerator, its FutureWarnings kept out of the table."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed")
    try:
        import deepspeed
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        from deepspeed.ops.op_builder import CPUAdamBuilder
    except ImportError as err:
        return None, (f"DeepSpeed is not installed ({err}): its row is skipped "
                      f"(pip install --no-build-isolation 'deepspeed>=0.19' to compare)")
    builder = CPUAdamBuilder()
    if not builder.is_compatible(verbose=True):
        return None, f"DeepSpeed {deepspeed.__version__}: its cpu_adam op is not compatible with this machine"
    print(f"DeepSpeed {deepspeed.__version__}: loading its cpu_adam op (JIT-built with g++/ninja on first use, "
          f"minutes; then cached) ...", flush=True)
    start = time.perf_counter()
    try:
        builder.load(verbose=False)
    except Exception as err:      # noqa: BLE001  (a failed build raises whatever the toolchain gave)
        lines = "".join(traceback.format_exception_only(type(err), err)).strip().splitlines()
        cause = err.__cause__ or err.__context__
        if cause is not None:
            lines += ["caused by:", *"".join(traceback.format_exception_only(type(cause), cause)).strip().splitlines()]
        return None, "DeepSpeed's cpu_adam op failed to build or load:\n    " + "\n    ".join(lines[-25:])
    flags = " ".join(a for a in builder.cxx_args() if a.startswith(("-march", "-D__AVX", "-fopenmp", "-O")))
    return (lambda ps: DeepSpeedCPUAdam(ps, adamw_mode=True, **HP),
            f"DeepSpeed {deepspeed.__version__}: cpu_adam op ready in {time.perf_counter() - start:.1f} s ({flags})")


def openmp_runtimes() -> list[tuple[str, int]]:
    """Every OpenMP runtime mapped into this process, with omp_get_max_threads() for this (the calling) thread."""
    libs = sorted({line.split()[-1] for line in open("/proc/self/maps")
                   if any(k in line for k in ("libgomp", "libiomp", "libomp"))})
    out = []
    for lib in libs:
        try:
            out.append((lib, ctypes.CDLL(lib).omp_get_max_threads()))
        except (OSError, AttributeError):
            out.append((lib, -1))
    return out


def threads_note() -> str:
    rts = openmp_runtimes()
    env = os.environ.get("OMP_NUM_THREADS", "unset")
    if len(rts) == 1:
        lib, n = rts[0]
        return (f"DeepSpeed's cpu_adam op runs its `omp parallel for` on OpenMP threads, here the same OpenMP runtime "
                f"torch loaded ({Path(lib).name}, one copy mapped): {n} threads, which torch.set_num_threads and "
                f"OMP_NUM_THREADS ({env}) set for both")
    return ("DeepSpeed's cpu_adam op runs its `omp parallel for` on its own OpenMP threads; runtimes mapped: "
            + ", ".join(f"{lib} ({n} threads)" for lib, n in rts) + f"; OMP_NUM_THREADS {env}")


@torch.no_grad()
def check_equal(factories: dict[str, Factory], params, snapshot) -> None:
    """One step of each from the snapshot: its weights against the first's, per tensor max |a - b| / max |a|, and
    the same difference as a share of the update (max |a - b| / max |a - w0|)."""
    ref = None
    print(f"one step from the same weights, against {next(iter(factories))}'s: max relative difference of the weights, "
          f"and of the update:")
    for name, make in factories.items():
        gc.collect()
        reset(params, snapshot)
        make(params).step()
        if ref is None:
            ref = [p.detach().clone() for p in params]
            continue
        dw = max(float((p - r).abs().max() / r.abs().max()) for p, r in zip(params, ref))
        du = max(float((p - r).abs().max() / (r - w).abs().max()) for p, r, w in zip(params, ref, snapshot))
        flag = "ok" if dw <= RTOL else f"DISAGREES beyond {RTOL:g}"
        print(f"  {name:<18} weights {dw:.1e}  update {du:.1e}  {flag}")
    del ref
    gc.collect()


def one_round(make: Factory, params, snapshot, steps: int, warmup: int) -> list[float]:
    """Seconds of each of `steps` steps of a fresh optimizer from the snapshot, after `warmup` untimed ones."""
    reset(params, snapshot)
    opt = make(params)
    for _ in range(warmup):
        opt.step()
    seconds = []
    for _ in range(steps):
        start = time.perf_counter()
        opt.step()
        seconds.append(time.perf_counter() - start)
    del opt
    gc.collect()
    return seconds


def interleave(factories: dict[str, Factory], params, snapshot, args) -> dict[str, list[list[float]]]:
    """`rounds` rounds A B C A B C ...; per optimizer, one list of step times per round."""
    times = {name: [] for name in factories}
    for r in range(args.rounds):
        for name, make in factories.items():
            times[name].append(one_round(make, params, snapshot, args.steps, args.warmup))
        print(f"  round {r + 1}/{args.rounds}: " + "  ".join(f"{n} {statistics.median(t[-1]):.3f} s"
                                                            for n, t in times.items()), flush=True)
    return times


def report(times: dict[str, list[list[float]]], n: int) -> None:
    steps = {name: [s for rnd in t for s in rnd] for name, t in times.items()}
    med = {name: statistics.median(s) for name, s in steps.items()}
    print(f"{'optimizer':<18} {'median s':>9} {'(min':>8} {'max)':>8} {'Mparams/s':>10} {'(min':>8} {'max)':>8}"
          + (f"  vs {DS}" if DS in med else ""))
    for name, s in steps.items():
        vs = f"{med[DS] / med[name]:.3f}x" if DS in med else ""
        print(f"{name:<18} {med[name]:>9.3f} {min(s):>8.3f} {max(s):>8.3f} {n / med[name] / 1e6:>10.0f} "
              f"{n / max(s) / 1e6:>8.0f} {n / min(s) / 1e6:>8.0f}  {vs}")
    if DS not in times:
        print(f"{FUSED} / {DS}: not measured (target >= {TARGET})")
        return
    rounds = len(times[FUSED])
    if rounds < MIN_ROUNDS:         # a bootstrap of 2 or 3 rounds is narrower than what it measures
        print(f"{FUSED} / {DS} = {med[DS] / med[FUSED]:.3f}   (target >= {TARGET}; {rounds} rounds: "
              f"{MIN_ROUNDS} give an interval)")
        return
    point, (lo, hi) = paired_ratio_ci(times[DS], times[FUSED])    # throughput ratio: DS time over fused time
    verdict = "met" if lo >= TARGET else "not met" if hi < TARGET else "within the noise"
    print(f"{FUSED} / {DS} = {med[DS] / med[FUSED]:.3f}; per round {point:.3f} [{lo:.3f}, {hi:.3f}]   "
          f"(target >= {TARGET}: {verdict})")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama-medium", help="preset whose parameter shapes are stepped")
    ap.add_argument("--untied", action="store_true", help="keep lm_head apart from the input embedding")
    ap.add_argument("--steps", type=int, default=4, help="timed steps per round")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps per round, the first allocating state")
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args(argv)
    shapes = param_shapes(args.model, tied=not args.untied)
    n = sum(s.numel() for _, s in shapes)
    params, snapshot = tensors(shapes)
    factories: dict[str, Factory] = {FUSED: lambda ps: torch.optim.AdamW(ps, fused=True, **HP),
                                     FOREACH: lambda ps: torch.optim.AdamW(ps, foreach=True, **HP)}
    ds, note = deepspeed_adam()
    print(note)
    if ds is not None:
        factories[DS] = ds
    print(f"{args.model} shapes, {'untied' if args.untied else 'tied'} embeddings: {n / 1e6:.1f}M float32 parameters "
          f"in {len(shapes)} tensors; lr {HP['lr']:g}, betas {HP['betas']}, eps {HP['eps']:g}, weight decay "
          f"{HP['weight_decay']:g}")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads (torch.get_num_threads()), CPU capability "
          f"{torch.backends.cpu.get_cpu_capability()}, OMP_WAIT_POLICY {os.environ.get('OMP_WAIT_POLICY')}, "
          f"{os.cpu_count()} cores")
    check_equal(factories, params, snapshot)
    if ds is not None:
        print(threads_note())
    print(f"{args.rounds} interleaved rounds of {args.warmup} untimed + {args.steps} timed steps each:")
    report(interleave(factories, params, snapshot, args), n)


if __name__ == "__main__":
    main()
