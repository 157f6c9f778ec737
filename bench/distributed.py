"""Two ranks (gloo, CPU): speedloader vs canonical tokens/s at small sub-batches, side by side.

    python bench/distributed.py [--model llama-small] [--b 1] [--n 8] [--seq 32] [--reps 3]

Each measurement is a 2-rank trial (run_trial with world_size 2), interleaved between the schedules.
Throughput is the slower rank's tokens/s; the collective volumes per step are the ranks' counters.
Both ranks share this machine's 2 cores, so each runs one compute thread.
"""

from __future__ import annotations

import argparse
import statistics

from sltune.profiling import run_trial
from sltune.sizes import format_bytes


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-small")
    ap.add_argument("--b", type=int, default=1)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--k", type=int, default=1)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    tps = {"speedloader": [], "canonical": []}
    last = {}
    for rep in range(args.reps):
        for schedule in (("speedloader", "canonical") if rep % 2 == 0 else ("canonical", "speedloader")):
            r = run_trial({"model": args.model, "world_size": 2, "schedule": schedule, "sub_batch_size": args.b,
                           "num_sub_batches": args.n, "num_live_blocks": args.k, "seq_len": args.seq,
                           "steps": args.steps, "profile": rep == 0, "timeout_s": 1800})
            assert r.status == "ok", r.error
            tps[schedule].append(r.tokens_per_s)
            last.setdefault(schedule, r)
    print(f"{args.model}, 2 gloo ranks, b={args.b} N={args.n} k={args.k} s={args.seq}, {args.reps} trials each")
    print(f"{'schedule':<12} {'tok/s/rank':>10} {'all-gather':>11} {'reduce-scat':>12} {'time in collectives':>20}")
    for s, values in tps.items():
        r = last[s]
        share = r.breakdown.all_gather + r.breakdown.reduce_scatter
        print(f"{s:<12} {statistics.median(values):>10.1f} {format_bytes(r.io.allgather_bytes):>11} "
              f"{format_bytes(r.io.reduce_scatter_bytes):>12} {share:>19.1%}")
    ratio = statistics.median(tps["speedloader"]) / statistics.median(tps["canonical"])
    print(f"speedloader / canonical = {ratio:.3f}")


if __name__ == "__main__":
    main()
