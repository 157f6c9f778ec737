"""oneshot against an exhaustive grid (and random, tpe at oneshot's budget), in one run.

    python bench/tuner.py [--model llama-tiny] [--device-limit 4MiB] [--reps 5]

The space: b in {1,2,4,8,16} x N in {1,2,4,8,16} x k in {1,2,4} = 75 configs under a device memory limit
that binds. Each strategy runs as its own job (its own SQLite database). Then the bests of grid and
oneshot are re-measured side by side, interleaved, with longer trials. Targets (issue #4): oneshot's
best within 5% of grid's, with at most 15% of grid's trials and 25% of its wall time.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from sltune.profiling import run_trial
from sltune.settings import Settings
from sltune.service.local import tune


def spec(model: str, limit: str, strategy: str, max_trials: int, seq: int) -> dict:
    return {"name": f"bench-{strategy}", "model": {"preset": model}, "workload": {"seq_len": seq},
            "hardware": {"device_memory_limit": limit},
            "search": {"strategy": strategy, "sub_batch_size": [1, 2, 4, 8, 16], "num_sub_batches": [1, 2, 4, 8, 16],
                       "num_live_blocks": [1, 2, 4], "max_trials": max_trials, "trial_steps": 2, "profile": False,
                       "time_budget_s": 7200, "seed": 0}}


def run(model, limit, strategy, max_trials, seq, root: Path) -> dict:
    data = root / strategy
    t0 = time.monotonic()
    result = tune(spec(model, limit, strategy, max_trials, seq), f"sqlite:///{data / 'jobs.db'}",
                  settings=Settings(data_dir=data))
    result["bench_wall"] = time.monotonic() - t0
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-tiny")
    ap.add_argument("--device-limit", default="4MiB")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="sltune-tuner-bench-"))

    grid = run(args.model, args.device_limit, "grid", 1000, args.seq, root)
    one = run(args.model, args.device_limit, "oneshot", 75, args.seq, root)
    budget = len(one["trials"])
    others = {s: run(args.model, args.device_limit, s, budget, args.seq, root) for s in ("random", "tpe")}

    print(f"{args.model}, seq {args.seq}, device limit {args.device_limit}: {grid['space_size']} configs")
    print(f"{'strategy':<9} {'trials':>6} {'%grid':>6} {'wall s':>7} {'%grid':>6} {'best tokens/s':>14}  best config")
    for name, r in [("grid", grid), ("oneshot", one), *others.items()]:
        best = r["best"] or {}
        c = best.get("config", {})
        print(f"{name:<9} {len(r['trials']):>6} {len(r['trials']) / len(grid['trials']):>6.1%} "
              f"{r['bench_wall']:>7.1f} {r['bench_wall'] / grid['bench_wall']:>6.1%} "
              f"{best.get('tokens_per_s', 0):>14.1f}  b={c.get('sub_batch_size')} N={c.get('num_sub_batches')} "
              f"k={c.get('num_live_blocks')}")

    # re-measure the two bests side by side, interleaved, longer trials
    picks = {"grid": grid["best"]["config"], "oneshot": one["best"]["config"]}
    tps = {k: [] for k in picks}
    for rep in range(args.reps):
        for name in (("grid", "oneshot") if rep % 2 == 0 else ("oneshot", "grid")):
            c = picks[name]
            r = run_trial({"model": args.model, "seq_len": args.seq, "steps": 5, "profile": False,
                           "device_memory_limit": args.device_limit, **{k: c[k] for k in (
                               "sub_batch_size", "num_sub_batches", "num_live_blocks")}})
            tps[name].append(r.tokens_per_s or 0.0)
    g, o = statistics.median(tps["grid"]), statistics.median(tps["oneshot"])
    print(f"re-measured ({args.reps} interleaved trials of 5 steps, medians): grid best {g:.1f}, oneshot best "
          f"{o:.1f} tokens/s: oneshot/grid = {o / g:.3f} (target >= 0.95)")
    print(f"oneshot used {len(one['trials']) / len(grid['trials']):.1%} of grid's trials (target <= 15%) and "
          f"{one['bench_wall'] / grid['bench_wall']:.1%} of its wall time (target <= 25%); stop: {one['stop_reason']}")


if __name__ == "__main__":
    main()
