"""The step-time prior against trials, in one interleaved run: every SpeedLoader config of a space predicted from
this machine's rates (sltune calibrate, at the spec's shapes) before any trial, then each measured by a real trial,
round after round (A B C ... A B C ...), so that a slow spell of the machine falls on every config alike.

    python bench/prior_time.py [--model llama-small] [--seq-len 128] [--rounds 3] [--budget 60]
        [--sub-batch-size 1 2 4 8] [--num-sub-batches 1 2 4] [--num-live-blocks 1 4] [--activations recompute offload]

prints each config's measured step (median [min, max] over the rounds), its prediction with the interval of the
rates' slowest and fastest samples, their ratio and the predicted breakdown, then the median and 90th percentile of
|error| and Spearman's rank correlation of the two orders. Run by hand (minutes), not in the suite.

Issue #49's goals for the prior before any trial: median |error| <= 15%, 90th percentile <= 30%, Spearman >= 0.85.
What is not here yet: DeepSpeed's and FSDP's configs (the prior does not model them), the errors after oneshot's
trials, and oneshot against the grid.
"""

from __future__ import annotations

import argparse
import statistics
import time

from sltune.machine import calibrate
from sltune.profiling import run_trial
from sltune.tuning.cost.admission import load
from sltune.tuning.cost.step_time import step_time
from sltune.tuning.cost.workload import workload_of
from sltune.tuning.search.state import SearchState
from sltune.tuning.search.trials import trial_spec


def spearman(xs: list[float], ys: list[float]) -> float:
    def ranks(v: list[float]) -> list[int]:
        out = [0] * len(v)
        for rank, i in enumerate(sorted(range(len(v)), key=v.__getitem__)):
            out[i] = rank
        return out

    rx, ry, n = ranks(xs), ranks(ys), len(xs)
    return 1 - 6 * sum((a - b) ** 2 for a, b in zip(rx, ry)) / (n * (n * n - 1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama-small")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds of trials; the median step is kept")
    p.add_argument("--budget", type=float, default=60.0, help="calibration's budget in seconds")
    p.add_argument("--sub-batch-size", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--num-sub-batches", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--num-live-blocks", type=int, nargs="+", default=[1, 4])
    p.add_argument("--activations", nargs="+", default=["recompute", "offload"])
    args = p.parse_args()
    ok = load({"model": {"preset": args.model, "dtype": args.dtype, "mixed_precision": args.dtype != "float32"},
               "workload": {"seq_len": args.seq_len},
               "search": {"sub_batch_size": args.sub_batch_size, "num_sub_batches": args.num_sub_batches,
                          "num_live_blocks": args.num_live_blocks, "activations": args.activations,
                          "trial_min_time_s": 1.0, "profile": False}}, "bench")
    state = SearchState(ok.spec, ok.shape, ok.space)
    configs = ok.space.candidates
    started = time.perf_counter()
    rates = calibrate(workload_of(ok.spec), budget_s=args.budget)
    print(f"{args.model} {args.dtype} seq {args.seq_len}: {len(configs)} configs, {args.rounds} interleaved rounds")
    print(f"calibrated in {rates.seconds:.1f}s: {rates.where()}")
    predicted = {c: step_time(state.recipe, c, rates, state.prior(c)) for c in configs}
    specs = {c: trial_spec(ok.spec, c, None) for c in configs}
    measured: dict = {c: [] for c in configs}
    for r in range(args.rounds):
        for c in configs:
            result = run_trial(specs[c])
            if result.status != "ok":
                raise SystemExit(f"{c}: {result.status}: {result.error}")
            measured[c].append(result.step_seconds)
        print(f"round {r + 1} done at {time.perf_counter() - started:.0f}s", flush=True)
    errors, xs, ys = [], [], []
    for c in configs:
        t, step = predicted[c], statistics.median(measured[c])
        errors.append(abs(t.seconds / step - 1))
        xs.append(step)
        ys.append(t.seconds)
        parts = " ".join(f"{k} {v:.3f}" for k, v in t.breakdown.items() if v)
        print(f"{c}: measured {step:.3f}s [{min(measured[c]):.3f}, {max(measured[c]):.3f}], predicted "
              f"{t.seconds:.3f}s [{t.fastest:.3f}, {t.slowest:.3f}], {t.seconds / step:.2f}x ({parts})")
    errors.sort()
    p90 = errors[min(len(errors) - 1, round(0.9 * (len(errors) - 1)))]
    print(f"|error| median {statistics.median(errors):.0%}, 90th percentile {p90:.0%}; Spearman "
          f"{spearman(xs, ys):.2f} over {len(configs)} configs; {time.perf_counter() - started:.0f}s in all")


if __name__ == "__main__":
    main()
