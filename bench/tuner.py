"""oneshot against an exhaustive grid, interleaved in one run (grid, oneshot, grid, oneshot, ...), with spreads.

    python bench/tuner.py [--space small|large|backends] [--reps 3] [--strategies oneshot,oneshot+prior,random,tpe]

Spaces (seq 64 and a device memory limit that binds, but for backends; the job's default trial timing):
- small: the 24 configs b {1,2,4,8} x N {1,2,4} x k {1,2} of a 4-layer GQA Llama (hidden 128, 4 heads, 2 KV heads,
  bf16 with float32 masters), oneshot with max_trials 8 (issue #30's check; target: wall <= 0.45x the grid's);
- large: the 90 configs b {1,2,4,8,16} x N {1,2,4,8,16,32} x k {1,2,4} of llama-tiny, oneshot with max_trials 20;
- backends: the 40 configs of llama-small in float32 at seq 128 over SpeedLoader (b {1,4} x N {1,2} x k {1,4}),
  DeepSpeed (ZeRO 2 and 3, the optimizer offloaded or not) and FSDP2 (CPU offload or not), recompute, no limit:
  bench/prior_time.py's space. oneshot with max_trials 20.

`oneshot` runs on its probes' fits alone (search.step_prior off); `oneshot+prior` is guided by the step-time prior
from this machine's rates, calibrated once before the first job (its seconds printed: a machine pays them once per
model shape) and stored into that job's database before it starts.

Each job runs in its own SQLite database. Per rep it prints each job's trials (search + confirm), wall time split
into the time before the first trial, the search's trials and the confirmation's, and its pick; then the
medians [min, max] of each strategy's wall and trials over the grid's of the same rep. Last, every rep's picks are
re-measured side by side with the grid's (longer trials, alternating order): each pick over the grid's, per rep.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from sltune.machine import Fingerprint, MachineRates
from sltune.profiling import forks, run_trial
from sltune.settings import Settings
from sltune.service.local import tune
from sltune.store import Store
from sltune.tuning.cost.admission import load
from sltune.tuning.cost.baseline import trial_baseline
from sltune.tuning.cost.stored_rates import calibrated, rates_key
from sltune.tuning.cost.workload import workload_of
from sltune.tuning.search.trials import trial_spec
from sltune.tuning.space import Candidate

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
    "backends": {"model": {"preset": "llama-small", "dtype": "float32", "mixed_precision": False}, "limit": None,
                 "seq_len": 128,
                 "knobs": {"backend": ["speedloader", "deepspeed", "fsdp"], "sub_batch_size": [1, 4],
                           "num_sub_batches": [1, 2], "num_live_blocks": [1, 4], "activations": ["recompute"],
                           "deepspeed": {"zero_stage": [2, 3], "offload_optimizer": ["none", "cpu"]},
                           "fsdp": {"cpu_offload": [False, True]}},
                 "max_trials": 20},
}


def spec(space: dict[str, Any], strategy: str, max_trials: int, rep: int) -> dict[str, Any]:
    guided = {"oneshot": "off", "oneshot+prior": "stored"}.get(strategy)
    return {"name": f"bench-{strategy}-{rep}", "model": space["model"],
            "workload": {"seq_len": space.get("seq_len", 64)},
            "hardware": {"device_memory_limit": space["limit"]} if space["limit"] else {},
            "search": {"strategy": strategy.split("+")[0], **space["knobs"], "max_trials": max_trials,
                       "time_budget_s": 7200, "seed": rep, **({"step_prior": guided} if guided else {})}}


def run(space: dict[str, Any], strategy: str, max_trials: int, rep: int, root: Path,
        rates: MachineRates | None) -> dict[str, Any]:
    data = root / f"{strategy}-{rep}"
    data.mkdir(parents=True)
    url = f"sqlite:///{data / 'jobs.db'}"
    job = spec(space, strategy, max_trials, rep)
    if strategy == "oneshot+prior":     # the machine's rates, as `sltune calibrate SPEC` stores them
        Store(url).save_rates(Fingerprint.here().key, rates_key(workload_of(load(job).spec).key, "bench"),
                              rates.model_dump(mode="json"))
    t0 = time.monotonic()
    result = tune(job, url, settings=Settings(data_dir=data))
    result["bench_wall"] = time.monotonic() - t0
    trials = Store(url).trials(result["job_id"])
    seconds = {role: sum((t.finished_at - t.started_at).total_seconds() for t in trials
                         if (t.role == "confirm") == (role == "confirm") and t.started_at and t.finished_at)
               for role in ("search", "confirm")}
    result["split"] = {**seconds, "other": result["bench_wall"] - sum(seconds.values())}
    return result


def knobs(r: dict[str, Any]) -> str:
    return str(Candidate.from_knobs((r["best"] or {}).get("config", {})))


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
    rates = None
    if "oneshot+prior" in names:
        t0 = time.monotonic()
        rates, _ = calibrated(Store(f"sqlite:///{root / 'rates.db'}"), load(spec(space, "oneshot+prior", 1, 0)).spec,
                              root, again=True)
        print(f"calibrated in {time.monotonic() - t0:.1f}s (once per machine and model shape): {rates.where()}",
              flush=True)
    runs: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    for rep in range(args.reps):
        for name in (names if rep % 2 == 0 else names[::-1]):
            r = run(space, name, 1000 if name == "grid" else space["max_trials"], rep, root, rates)
            runs[name].append(r)
            s = r["split"]
            confirms = sum(t["role"] == "confirm" for t in r["trials"])
            print(f"rep {rep} {name:<13} {len(r['trials']) - confirms:>3} search + {confirms} confirm trials, "
                  f"{r['bench_wall']:6.1f}s (before/between trials {s['other']:5.1f}s, search {s['search']:5.1f}s, "
                  f"confirm {s['confirm']:5.1f}s); best {knobs(r)} {r['best']['tokens_per_s']:.1f} tokens/s; "
                  f"{r['stop_reason']}", flush=True)

    grid = runs["grid"]
    print(f"\n{args.space} space: {grid[0]['space_size']} configs, {args.reps} interleaved reps; "
          "ratios to the grid of the same rep, median [min, max]")
    for name in names[1:]:
        wall = [r["bench_wall"] / g["bench_wall"] for r, g in zip(runs[name], grid)]
        trials = [len(r["trials"]) / len(g["trials"]) for r, g in zip(runs[name], grid)]
        print(f"{name:<13} wall {spread(wall)}x, trials {spread(trials)}x "
              f"({spread([len(r['trials']) for r in runs[name]], '{:.0f}')} of "
              f"{spread([len(g['trials']) for g in grid], '{:.0f}')}); confirm seconds "
              f"{spread([r['split']['confirm'] for r in runs[name]], '{:.1f}')}")

    # each rep's picks re-measured side by side, alternating which goes first
    for name in names[1:]:
        ratios = []
        for rep, (r, g) in enumerate(zip(runs[name], grid)):
            tps = {}
            for who, res in ((("grid", g), (name, r)) if rep % 2 == 0 else ((name, r), ("grid", g))):
                job = load(spec(space, "grid", 1, rep)).spec
                job = job.model_copy(update={"search": job.search.model_copy(update={
                    "trial_steps": args.remeasure_steps, "trial_min_time_s": 0.0, "profile": False})})
                with tempfile.TemporaryDirectory(dir=root) as folder:
                    out = run_trial(trial_spec(job, Candidate.from_knobs(res["best"]["config"]), None,
                                               offload_dir=Path(folder)))
                tps[who] = out.tokens_per_s or 0.0
            ratios.append(tps[name] / tps["grid"] if tps["grid"] else 0.0)
        print(f"{name}'s pick over the grid's, re-measured side by side per rep: {spread(ratios, '{:.3f}')}")

if __name__ == "__main__":
    main()
