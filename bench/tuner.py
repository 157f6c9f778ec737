"""oneshot against an exhaustive grid, interleaved in one run (grid, oneshot, grid, oneshot, ...), with spreads.

    python bench/tuner.py [--space small|large] [--reps 3] [--strategies oneshot,random,tpe]

Spaces (each under a device memory limit that binds, seq 64, the job's default trial timing):
- small: the 24 configs b {1,2,4,8} x N {1,2,4} x k {1,2} of a 4-layer GQA Llama (hidden 128, 4 heads, 2 KV heads,
  bf16 with float32 masters), oneshot with max_trials 8 (issue #30's check; target: wall <= 0.45x the grid's);
- large: the 90 configs b {1,2,4,8,16} x N {1,2,4,8,16,32} x k {1,2,4} of llama-tiny, oneshot with max_trials 20.

Each job runs in its own SQLite database. Per rep it prints each job's trials (search + confirm), wall time split
into the time before the first trial, the search's trials and the confirmation's, and its pick; then the
medians [min, max] of oneshot's wall and trials over the grid's of the same rep. Last, every rep's two picks are
re-measured side by side (longer trials, alternating order): oneshot's pick over the grid's, per rep.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from sltune.profiling import forks, run_trial
from sltune.settings import Settings
from sltune.service.local import tune
from sltune.store import Store
from sltune.tuning.cost.baseline import trial_baseline

GQA = {"model_type": "llama", "vocab_size": 1024, "hidden_size": 128, "intermediate_size": 352, "num_hidden_layers": 4,
       "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 1024, "bos_token_id": 1,
       "eos_token_id": 2, "pad_token_id": 0}
SPACES = {
    "small": {"model": {"hf_config": GQA, "dtype": "bfloat16", "mixed_precision": True}, "limit": "8MiB",
              "knobs": {"sub_batch_size": [1, 2, 4, 8], "num_sub_batches": [1, 2, 4], "num_live_blocks": [1, 2]},
              "max_trials": 8},
    "large": {"model": {"preset": "llama-tiny"}, "limit": "4MiB",
              "knobs": {"sub_batch_size": [1, 2, 4, 8, 16], "num_sub_batches": [1, 2, 4, 8, 16, 32],
                        "num_live_blocks": [1, 2, 4]},
              "max_trials": 20},
}


def spec(space: dict[str, Any], strategy: str, max_trials: int, rep: int) -> dict[str, Any]:
    return {"name": f"bench-{strategy}-{rep}", "model": space["model"], "workload": {"seq_len": 64},
            "hardware": {"device_memory_limit": space["limit"]},
            "search": {"strategy": strategy, **space["knobs"], "max_trials": max_trials, "time_budget_s": 7200,
                       "seed": rep}}


def run(space: dict[str, Any], strategy: str, max_trials: int, rep: int, root: Path) -> dict[str, Any]:
    data = root / f"{strategy}-{rep}"
    url = f"sqlite:///{data / 'jobs.db'}"
    t0 = time.monotonic()
    result = tune(spec(space, strategy, max_trials, rep), url, settings=Settings(data_dir=data))
    result["bench_wall"] = time.monotonic() - t0
    trials = Store(url).trials(result["job_id"])
    seconds = {role: sum((t.finished_at - t.started_at).total_seconds() for t in trials
                         if (t.role == "confirm") == (role == "confirm") and t.started_at and t.finished_at)
               for role in ("search", "confirm")}
    result["split"] = {**seconds, "other": result["bench_wall"] - sum(seconds.values())}
    return result


def knobs(r: dict[str, Any]) -> dict[str, int]:
    c = (r["best"] or {}).get("config", {})
    return {k: c[k] for k in ("sub_batch_size", "num_sub_batches", "num_live_blocks")}


def spread(xs: list[float], fmt: str = "{:.2f}") -> str:
    return f"{fmt.format(statistics.median(xs))} [{fmt.format(min(xs))}, {fmt.format(max(xs))}]"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--space", choices=SPACES, default="small")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--strategies", default="oneshot", help="compared with the grid, comma-separated")
    ap.add_argument("--remeasure-steps", type=int, default=5)
    args = ap.parse_args()
    space = SPACES[args.space]
    root = Path(tempfile.mkdtemp(prefix="sltune-tuner-bench-"))
    names = ["grid", *args.strategies.split(",")]
    # what every job of this process shares, paid before the first: the trials' fork server and the trial baseline
    forks.start()
    trial_baseline("cpu", 1, "train")
    runs: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    for rep in range(args.reps):
        for name in (names if rep % 2 == 0 else names[::-1]):
            r = run(space, name, 1000 if name == "grid" else space["max_trials"], rep, root)
            runs[name].append(r)
            s, k = r["split"], knobs(r)
            confirms = sum(t["role"] == "confirm" for t in r["trials"])
            print(f"rep {rep} {name:<8} {len(r['trials']) - confirms:>3} search + {confirms} confirm trials, "
                  f"{r['bench_wall']:6.1f}s (before/between trials {s['other']:5.1f}s, search {s['search']:5.1f}s, "
                  f"confirm {s['confirm']:5.1f}s); best b={k['sub_batch_size']} N={k['num_sub_batches']} "
                  f"k={k['num_live_blocks']} {r['best']['tokens_per_s']:.1f} tokens/s", flush=True)

    grid = runs["grid"]
    print(f"\n{args.space} space: {grid[0]['space_size']} configs, {args.reps} interleaved reps; "
          "ratios to the grid of the same rep, median [min, max]")
    for name in names[1:]:
        wall = [r["bench_wall"] / g["bench_wall"] for r, g in zip(runs[name], grid)]
        trials = [len(r["trials"]) / len(g["trials"]) for r, g in zip(runs[name], grid)]
        print(f"{name:<8} wall {spread(wall)}x, trials {spread(trials)}x "
              f"({spread([len(r['trials']) for r in runs[name]], '{:.0f}')} of "
              f"{spread([len(g['trials']) for g in grid], '{:.0f}')}); confirm seconds "
              f"{spread([r['split']['confirm'] for r in runs[name]], '{:.1f}')}")

    # each rep's picks re-measured side by side, alternating which goes first
    for name in names[1:]:
        ratios = []
        for rep, (r, g) in enumerate(zip(runs[name], grid)):
            tps = {}
            for who, res in ((("grid", g), (name, r)) if rep % 2 == 0 else ((name, r), ("grid", g))):
                model = space["model"]
                out = run_trial({"model": model.get("preset") or model["hf_config"], "dtype": model.get("dtype", "float32"),
                                 "mixed_precision": model.get("mixed_precision", True), "seq_len": 64,
                                 "steps": args.remeasure_steps, "profile": False,
                                 "device_memory_limit": space["limit"], **knobs(res)})
                tps[who] = out.tokens_per_s or 0.0
            ratios.append(tps[name] / tps["grid"] if tps["grid"] else 0.0)
        print(f"{name}'s pick over the grid's, re-measured side by side per rep: {spread(ratios, '{:.3f}')}")


if __name__ == "__main__":
    main()
