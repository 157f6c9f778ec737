"""The step-time prior against trials, in one interleaved run: every config of a space (SpeedLoader's, and with
--backend DeepSpeed's and FSDP's) predicted from this machine's rates (sltune calibrate, at the spec's shapes) before
any trial, then each measured by a real trial, round after round (A B C ... A B C ...), so that a slow spell of the
machine falls on every config alike.

    python bench/prior_time.py [--model llama-small] [--seq-len 128] [--rounds 3] [--budget 60]
        [--sub-batch-size 1 2 4 8] [--num-sub-batches 1 2 4] [--num-live-blocks 1 4] [--activations recompute offload]
        [--backend speedloader deepspeed fsdp] [--zero-stage 2 3] [--offload-optimizer none cpu]
        [--cpu-offload false true] [--save FILE | --replay FILE]
    python bench/prior_time.py --mode generate [--prompt-len 32] [--new-tokens 16] [--kv-cache host device]
        [--weights-on-device 0 0.5 1] ...     (generation: a step is one generate call)

prints each config's measured step (median [min, max] over the rounds), its prediction with the interval of the
rates' slowest and fastest samples, their ratio and the predicted breakdown, then the median and 90th percentile of
|error| and Spearman's rank correlation of the two orders, over every config and per backend. --save keeps the rates
and the trials' steps; --replay predicts them again with this checkout's prior, so that a change to the prior is
judged against the very trials the one before it was. Run by hand
(minutes; a DeepSpeed trial takes 10-20 s here), not in the suite.

Issue #49's goals for the prior before any trial: median |error| <= 15%, 90th percentile <= 30%, Spearman >= 0.85.
After them, the same errors of the configs oneshot's probes did not measure, the prior corrected by the probes'
steps (sltune.tuning.cost.correction; #49's goal after the tuner's trials: median |error| <= 8%). What is not
here yet: oneshot against the grid.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from sltune.backends.deepspeed import deepspeed_adam
from sltune.machine import calibrate
from sltune.machine.rates import MachineRates
from sltune.profiling import run_trial
from sltune.tuning.cost.admission import load
from sltune.tuning.cost.correction import Correction
from sltune.tuning.cost.step_time import step_time
from sltune.tuning.cost.workload import workload_of
from sltune.tuning.search.state import SearchState
from sltune.tuning.search.strategies import OneShotStrategy
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
    p.add_argument("--backend", nargs="+", default=["speedloader"], choices=["speedloader", "deepspeed", "fsdp"])
    p.add_argument("--zero-stage", type=int, nargs="+", default=[2, 3])
    p.add_argument("--offload-optimizer", nargs="+", default=["none", "cpu"])
    p.add_argument("--cpu-offload", nargs="+", default=["false", "true"], choices=["false", "true"])
    p.add_argument("--mode", default="train", choices=["train", "generate"])
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--kv-cache", nargs="+", default=["host", "device"])
    p.add_argument("--weights-on-device", type=float, nargs="+", default=[0.0, 0.5, 1.0])
    p.add_argument("--save", metavar="FILE", help="write the rates and every trial's steps here (JSON)")
    p.add_argument("--replay", metavar="FILE", help="no calibration and no trials: the rates and steps a --save "
                   "wrote, predicted by this checkout's prior (a change to the prior against the same trials)")
    args = p.parse_args()
    search = {"backend": args.backend, "sub_batch_size": args.sub_batch_size,
              "num_sub_batches": args.num_sub_batches, "trial_min_time_s": 1.0, "profile": False}
    workload = {"seq_len": args.seq_len}
    if args.mode == "train":
        search["activations"] = args.activations
    else:
        search |= {"kv_cache": args.kv_cache, "weights_on_device": args.weights_on_device}
        workload = {"mode": "generate", "prompt_len": args.prompt_len, "new_tokens": args.new_tokens}
    if "speedloader" in args.backend:
        search["num_live_blocks"] = args.num_live_blocks
    if "deepspeed" in args.backend:
        search["deepspeed"] = {"zero_stage": args.zero_stage, "offload_optimizer": args.offload_optimizer}
    if "fsdp" in args.backend:
        search["fsdp"] = {"cpu_offload": [v == "true" for v in args.cpu_offload]}
    ok = load({"model": {"preset": args.model, "dtype": args.dtype, "mixed_precision": args.dtype != "float32"},
               "workload": workload, "search": search}, "bench")
    state = SearchState(ok.spec, ok.shape, ok.space)
    configs = ok.space.candidates
    started = time.perf_counter()
    saved = json.loads(Path(args.replay).read_text()) if args.replay else None
    if saved is not None:
        rates = MachineRates.model_validate(saved["rates"])
    else:
        optimizers = {f"torch.{ok.spec.optimizer.name}": ok.spec.optimizer.build,
                      **(deepspeed_adam("cpu") if "deepspeed" in args.backend else {})}
        rates = calibrate(workload_of(ok.spec), budget_s=args.budget, optimizers=optimizers)
    what = f"seq {args.seq_len}" if args.mode == "train" else \
        f"generate {args.prompt_len}+{args.new_tokens} tokens"
    print(f"{args.model} {args.dtype} {what}: {len(configs)} configs, {args.rounds} interleaved rounds")
    print(f"calibrated in {rates.seconds:.1f}s: {rates.where()}")
    predicted = {c: step_time(state.recipe, c, rates, state.prior(c)) for c in configs}
    specs = {c: trial_spec(ok.spec, c, None) for c in configs}
    measured: dict = {c: [] for c in configs}
    if saved is not None:
        steps = {json.dumps(t["config"], sort_keys=True): t["steps"] for t in saved["trials"]}
        measured = {c: steps[json.dumps(c.knobs(named=True), sort_keys=True)] for c in configs}
    for r in range(0 if saved is not None else args.rounds):
        for c in configs:
            result = run_trial(specs[c])
            if result.status != "ok":
                raise SystemExit(f"{c}: {result.status}: {result.error}")
            measured[c].append(result.step_seconds)
        print(f"round {r + 1} done at {time.perf_counter() - started:.0f}s", flush=True)
    if args.save:
        Path(args.save).write_text(json.dumps({"rates": rates.model_dump(mode="json"), "trials": [
            {"config": c.knobs(named=True), "steps": measured[c]} for c in configs]}, indent=1) + "\n")
    for c in configs:
        t, step = predicted[c], statistics.median(measured[c])
        parts = " ".join(f"{k} {v:.3f}" for k, v in t.breakdown.items() if v)
        print(f"{c}: measured {step:.3f}s [{min(measured[c]):.3f}, {max(measured[c]):.3f}], predicted "
              f"{t.seconds:.3f}s [{t.fastest:.3f}, {t.slowest:.3f}], {t.seconds / step:.2f}x ({parts})")
    groups = {"every config": configs} | ({b: [c for c in configs if c.backend == b] for b in args.backend}
                                         if len(args.backend) > 1 else {})
    print("before any trial:")
    summary(groups, measured, {c: t.seconds for c, t in predicted.items()})
    # after oneshot's probes (each backend's, its first round's trials): their steps correct the prior of the
    # configs they did not measure (sltune.tuning.cost.correction)
    probes = OneShotStrategy(state, 0).probes()
    fixes = {b: Correction.of([(predicted[c], measured[c][0], c.num_sub_batches) for c in probes
                               if c.backend == b]) for b in args.backend}
    for b, fix in fixes.items():
        if fix is not None:
            print(f"{b}: corrected by its probes: {fix.describe()}")
    rest = {name: [c for c in group if c not in probes] for name, group in groups.items()}
    print(f"after oneshot's {len(probes)} probes (their first round), the other configs:")
    summary(rest, measured, {c: fixes[c.backend].apply(t, c.num_sub_batches).seconds if fixes[c.backend]
                             else t.seconds for c, t in predicted.items()})
    print(f"{time.perf_counter() - started:.0f}s in all")


def summary(groups: dict, measured: dict, guessed: dict) -> None:
    """Each group's |error| median and 90th percentile and its Spearman rank correlation."""
    for name, group in groups.items():
        if not group:
            continue
        steps = [statistics.median(measured[c]) for c in group]
        guesses = [guessed[c] for c in group]
        errors = sorted(abs(g / m - 1) for g, m in zip(guesses, steps))
        p90 = errors[min(len(errors) - 1, round(0.9 * (len(errors) - 1)))]
        print(f"  {name}: |error| median {statistics.median(errors):.0%}, 90th percentile {p90:.0%}; Spearman "
              f"{spearman(steps, guesses):.2f} over {len(group)} configs")


if __name__ == "__main__":
    main()
