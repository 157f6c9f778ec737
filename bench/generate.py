"""Generated tokens/s: SpeedLoader vs transformers' own generate (weights resident) vs the canonical schedule.

Also shown: the resident schedule (the same sub-batched compute, nothing moved: what the copies cost) and
transformers called on one sub-batch of b rows at a time (what fits a device that holds b rows).

    python bench/generate.py [--model llama-small] [--b 4] [--n 4] [--k 1] [--prompt 32] [--new 32] [--reps 5]
                             [--threads T]

All runs use the same weights and prompts, interleaved so machine noise hits them alike; end-of-sequence
stopping is off so every run generates b*N*new tokens, and the tokens are checked to be identical.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from typing import Callable

import torch

from sltune import SpeedLoaderConfig, SpeedLoaderEngine
from sltune.models import build, param_count
from sltune.sizes import format_bytes


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-small")
    ap.add_argument("--b", type=int, default=4)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--k", type=int, default=1)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads; 1 keeps figures stable on a machine shared with other jobs")
    args = ap.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    base = build(args.model, seed=0).eval()
    rows = args.b * args.n
    ids = torch.randint(3, base.config.vocab_size, (rows, args.prompt), generator=torch.Generator().manual_seed(0))

    hf = copy.deepcopy(base)
    hf.generation_config.eos_token_id = None          # generate exactly --new tokens, like the engines below
    hf.generation_config.pad_token_id = 0
    engines = {}
    for schedule in ("speedloader", "canonical", "resident"):
        cfg = SpeedLoaderConfig(sub_batch_size=args.b, num_sub_batches=args.n, num_live_blocks=args.k,
                                schedule=schedule, memory_tracking="never")
        engines[schedule] = SpeedLoaderEngine(copy.deepcopy(base), cfg, optimizer=None)

    runs: dict[str, Callable[[], torch.Tensor]] = {
        "speedloader": lambda: engines["speedloader"].generate(ids, max_new_tokens=args.new, eos_token_id=[]),
        "transformers": lambda: hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.new,
                                            do_sample=False),
        "hf per sub-batch": lambda: torch.cat([
            hf.generate(part, attention_mask=torch.ones_like(part), max_new_tokens=args.new, do_sample=False)
            for part in ids.split(args.b)]),
        "canonical": lambda: engines["canonical"].generate(ids, max_new_tokens=args.new, eos_token_id=[]),
        "resident": lambda: engines["resident"].generate(ids, max_new_tokens=args.new, eos_token_id=[]),
    }
    print(f"model {args.model}: {param_count(args.model) / 1e6:.1f}M parameters, b={args.b} N={args.n} "
          f"(batch {rows}) k={args.k}, prompt {args.prompt} + {args.new} new tokens, "
          f"torch threads {torch.get_num_threads()}")
    outputs = {name: run() for name, run in runs.items()}             # warm-up, and the tokens to compare
    same = all(torch.equal(out, outputs["transformers"]) for out in outputs.values())
    times: dict[str, list[float]] = {name: [] for name in runs}
    names = list(runs)
    for rep in range(args.reps):
        for name in names if rep % 2 == 0 else names[::-1]:
            start = time.perf_counter()
            runs[name]()
            times[name].append(time.perf_counter() - start)
    tps = {name: rows * args.new / statistics.median(t) for name, t in times.items()}

    print(f"{'run':<16} {'tokens/s':>9} {'median s':>9} {'param load/step':>16} {'kv in+out/call':>15}")
    for name in names:
        stats = engines[name].last_generation if name in engines else None
        load = format_bytes(stats.step_io[-1].param_load_bytes) if stats else "-"
        kv = format_bytes(stats.io.kv_load_bytes + stats.io.kv_offload_bytes) if stats else "-"
        print(f"{name:<16} {tps[name]:>9.1f} {statistics.median(times[name]):>9.3f} {load:>16} {kv:>15}")
    print(f"tokens identical across all runs: {same}")
    print(f"speedloader / transformers     = {tps['speedloader'] / tps['transformers']:.3f}")
    print(f"speedloader / hf per sub-batch = {tps['speedloader'] / tps['hf per sub-batch']:.3f}")
    print(f"speedloader / canonical        = {tps['speedloader'] / tps['canonical']:.3f}")
    print(f"speedloader / resident         = {tps['speedloader'] / tps['resident']:.3f}")


if __name__ == "__main__":
    main()
