"""Tokens/s of the three schedules side by side, interleaved so machine noise hits them alike.

    python bench/runtime.py [--model llama-small] [--b 1] [--seq 32] [--n 8] [--k 1] [--reps 8]

Targets on the CPU (issue #2): speedloader >= 0.9x resident and >= 1.2x canonical.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

from sltune import SpeedLoaderConfig, SpeedLoaderEngine
from sltune.models import build, param_count
from sltune.sizes import format_bytes

SCHEDULES = ("resident", "speedloader", "canonical")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-small")
    ap.add_argument("--b", type=int, default=1)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--k", type=int, default=1)
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    args = ap.parse_args()

    base = build(args.model, seed=0)
    rows = args.b * args.n
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, base.config.vocab_size, (rows, args.seq), generator=gen) for _ in range(4)]
    engines = {}
    for name in SCHEDULES:
        cfg = SpeedLoaderConfig(sub_batch_size=args.b, num_sub_batches=args.n, num_live_blocks=args.k,
                                schedule=name, memory_tracking="never")
        engines[name] = SpeedLoaderEngine(copy.deepcopy(base), cfg,
                                          optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-4))
    print(f"model {args.model}: {param_count(args.model) / 1e6:.1f}M parameters, b={args.b} s={args.seq} "
          f"N={args.n} k={args.k}, torch threads {torch.get_num_threads()}")
    for name, eng in engines.items():
        for i in range(args.warmup):
            eng.train_step(batches[i % len(batches)])
    times = {name: [] for name in SCHEDULES}
    io = {}
    for rep in range(args.reps):
        order = SCHEDULES if rep % 2 == 0 else SCHEDULES[::-1]
        for name in order:
            res = engines[name].train_step(batches[rep % len(batches)])
            times[name].append(res.seconds)
            io[name] = res.io
    tps = {name: rows * args.seq / statistics.median(t) for name, t in times.items()}
    print(f"{'schedule':<12} {'tokens/s':>10} {'median s':>9} {'param load':>11} {'grad offload':>13} {'act out+in':>11}")
    for name in SCHEDULES:
        i = io[name]
        print(f"{name:<12} {tps[name]:>10.1f} {statistics.median(times[name]):>9.3f} "
              f"{format_bytes(i.param_load_bytes):>11} {format_bytes(i.grad_offload_bytes):>13} "
              f"{format_bytes(i.act_offload_bytes + i.act_load_bytes):>11}")
    print(f"speedloader / resident  = {tps['speedloader'] / tps['resident']:.3f}   (target >= 0.9)")
    print(f"speedloader / canonical = {tps['speedloader'] / tps['canonical']:.3f}   (target >= 1.2)")


if __name__ == "__main__":
    main()
