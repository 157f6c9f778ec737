"""The first measurement on a GPU: tokens/s, MFU and measured copy overlap of every way to train, side by side.

    python bench/gpu.py [--model llama-medium] [--b 4] [--n 8] [--k 1] [--seq 1024] [--dtype bfloat16]
                        [--rounds 3] [--steps 3] [--peak-tflops 312] [--no-deepspeed]

Per round it runs each contender in turn (the order alternates between rounds, so drift hits them alike):
sltune's resident, speedloader and canonical schedules, and DeepSpeed ZeRO-3 with parameters and optimizer
offloaded to the host (`pip install deepspeed`; the same model, b, N, AdamW), each on a fresh copy of the
model: warm-up, `--steps` timed optimizer steps, then one profiled step. It prints the median tokens/s, the
MFU (6 * parameters + 12 * layers * hidden * seq FLOPs per token, against the GPU's dense peak for the
dtype, from a small table or --peak-tflops), and the share of host<->device copy time that compute kernels
hide (from the profiler's device timeline: the overlap the prefetch exists for). A contender that runs out
of memory says so. Without a GPU it says so and exits 0.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
from typing import Callable

import torch

from sltune import SpeedLoaderConfig, SpeedLoaderEngine
from sltune.models import build
from sltune.profiling.breakdown import profile_call
from sltune.runtime.regions import step_region

SCHEDULES = ("resident", "speedloader", "canonical")
# dense tensor-core TFLOP/s by GPU name (bfloat16, or float16 where the GPU has no bfloat16)
PEAK_TFLOPS = {"H100 SXM": 989.0, "H100": 756.0, "A100": 312.0, "L40S": 362.0, "A10": 125.0, "L4": 121.0,
               "V100": 125.0, "T4": 65.0}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-medium", help="a preset, e.g. llama-2-7b for the paper's smallest")
    ap.add_argument("--b", type=int, default=4)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--k", type=int, default=1)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--peak-tflops", type=float, default=None)
    ap.add_argument("--no-deepspeed", action="store_true")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no GPU on this machine (torch.cuda.is_available() is False): nothing to measure. Run this on a "
              "machine with a CUDA GPU and a CUDA build of torch.")
        return 0

    name = torch.cuda.get_device_name()
    peak = args.peak_tflops or next((v for k, v in PEAK_TFLOPS.items() if k in name), None)
    probe = build(args.model, seed=0)
    params = sum(p.numel() for p in probe.parameters())
    cfg = probe.config
    flops_per_token = 6 * params + 12 * cfg.num_hidden_layers * cfg.hidden_size * args.seq
    del probe
    rows = args.b * args.n
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, cfg.vocab_size, (rows, args.seq), generator=gen) for _ in range(args.steps + 3)]

    contenders: dict[str, Callable[[], Callable[[torch.Tensor], None]]] = {
        s: (lambda s=s: _sltune(args, s)) for s in SCHEDULES}
    if not args.no_deepspeed:
        contenders["deepspeed-zero3-offload"] = lambda: _deepspeed(args)
    results: dict[str, dict] = {c: {"tps": [], "hidden": None, "error": None} for c in contenders}
    for r in range(args.rounds):
        order = list(contenders) if r % 2 == 0 else list(contenders)[::-1]
        for c in order:
            if results[c]["error"]:
                continue
            try:
                step = contenders[c]()
                step(batches[0])                                           # warm-up
                times = []
                for i in range(args.steps):
                    torch.cuda.synchronize()
                    start = torch.cuda.Event(enable_timing=True)
                    end = torch.cuda.Event(enable_timing=True)
                    start.record()
                    step(batches[1 + i])
                    end.record()
                    end.synchronize()
                    times.append(start.elapsed_time(end) / 1000)
                results[c]["tps"].append(rows * args.seq / statistics.median(times))
                if results[c]["hidden"] is None:
                    results[c]["hidden"] = profile_call(lambda: step(batches[-1])).copy_hidden
            except torch.OutOfMemoryError as err:
                results[c]["error"] = f"out of memory: {str(err).splitlines()[0]}"
            except ImportError as err:
                results[c]["error"] = f"not installed ({err}); pip install deepspeed"
            finally:
                step = None
                gc.collect()
                torch.cuda.empty_cache()

    print(f"{name}: {args.model} ({params / 1e9:.2f}B parameters), {args.dtype}, b={args.b} N={args.n} k={args.k} "
          f"s={args.seq}, {args.rounds} rounds of {args.steps} steps; peak {peak or '?'} TFLOP/s")
    print(f"{'contender':<24} {'tokens/s':>10} {'MFU':>7} {'copy hidden':>12}")
    for c, r in results.items():
        if r["error"]:
            print(f"{c:<24} {r['error']}")
            continue
        tps = statistics.median(r["tps"])
        mfu = f"{100 * tps * flops_per_token / (peak * 1e12):.1f}%" if peak else "-"
        hidden = "-" if r["hidden"] is None else f"{100 * r['hidden']:.0f}%"
        print(f"{c:<24} {tps:>10.1f} {mfu:>7} {hidden:>12}")
    if not peak:
        print("MFU needs the GPU's dense peak: pass --peak-tflops")
    return 0


def _sltune(args, schedule: str) -> Callable[[torch.Tensor], None]:
    cfg = SpeedLoaderConfig(sub_batch_size=args.b, num_sub_batches=args.n, num_live_blocks=args.k,
                            schedule=schedule, device="cuda", dtype=args.dtype, memory_tracking="never")
    engine = SpeedLoaderEngine(build(args.model, seed=0), cfg, optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-5))
    return lambda ids: engine.train_step(ids)


def _deepspeed(args) -> Callable[[torch.Tensor], None]:
    """ZeRO-3 with parameters and optimizer state on the host: N micro-batches of b rows per optimizer step."""
    import deepspeed

    for key, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29517"), ("RANK", "0"),
                       ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
        os.environ.setdefault(key, value)
    deepspeed.init_distributed()
    config = {
        "train_micro_batch_size_per_gpu": args.b, "gradient_accumulation_steps": args.n,
        "bf16": {"enabled": args.dtype == "bfloat16"}, "fp16": {"enabled": args.dtype == "float16"},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-5}},
        "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "pin_memory": True},
                              "offload_optimizer": {"device": "cpu", "pin_memory": True}},
    }
    model = build(args.model, seed=0)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)

    def step(ids: torch.Tensor) -> None:
        with step_region():                      # the profiler's breakdown reads one step per call
            for i in range(args.n):
                rows = ids[i * args.b:(i + 1) * args.b].cuda()
                engine.backward(engine(input_ids=rows, labels=rows).loss)
                engine.step()
            torch.cuda.synchronize()

    return step


if __name__ == "__main__":
    sys.exit(main())
