"""Probes at reduced depth (issue #25): oneshot with search.probe_layers auto against full-depth oneshot and
the full-depth grid, in one run.

    python bench/depth.py [--seq 96] [--device-limit 150MiB] [--repeats 2] [--rounds 4] [--min-time 2]

The model: llama-small's widths (hidden 512, 8 heads, MLP 1408, vocab 8192) at 16 layers, float32 with AdamW,
59M parameters: at seq 64 its smallest config stepped in 0.41-0.45 s on this 2-core CPU when quiet and about twice
that beside other processes, so seq 96 by default; the largest configs take several seconds.
The space: b in {1, 2, 4, 8} x N in {1, 2, 4} x k in {1, 2} = 24 configs under a device limit. Each job is its
own SQLite database; the oneshot jobs alternate, full depth and auto (A B B A), so that both see the machine's
moods. Then the picks are re-measured side by side, interleaved (A B C, C B A, ...), and the ratios to the grid's
best are the medians of the per-round ratios with a paired bootstrap interval. The probes' own fits are also
checked against the grid's full-depth trials (every config, not only the frontier).

Targets: the auto pick >= 0.95x the grid's best; the auto job's probe time (its probe trials, start to finish)
<= 35% of the full-depth oneshot's. It prints the probes' fits' full-depth errors. The machine may be shared:
the spread and the cores other processes kept busy are printed with the figures.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

# sltune is imported inside the functions: a trial process imports this file again as its main module, and
# needs none of it
MODEL = {"model_type": "llama", "vocab_size": 8192, "hidden_size": 512, "intermediate_size": 1408,
         "num_hidden_layers": 16, "num_attention_heads": 8, "num_key_value_heads": 8,
         "max_position_embeddings": 2048, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}


def spec(args, name: str, strategy: str, probe_layers: Any = None) -> dict:
    search = {"strategy": strategy, "sub_batch_size": [1, 2, 4, 8], "num_sub_batches": [1, 2, 4],
              "num_live_blocks": [1, 2], "max_trials": 100, "trial_min_time_s": args.min_time, "profile": False,
              "time_budget_s": 7200, "trial_timeout_s": 900, "seed": 0}
    if probe_layers is not None:
        search["probe_layers"] = probe_layers
    return {"name": name, "model": {"hf_config": MODEL}, "workload": {"seq_len": args.seq},
            "hardware": {"device_memory_limit": args.device_limit}, "search": search}


def run_job(s: dict, root: Path) -> dict[str, Any]:
    from sltune.profiling.timing import timing_of
    from sltune.service.local import tune
    from sltune.settings import Settings
    from sltune.store import Store

    data = root / s["name"]
    db = f"sqlite:///{data / 'jobs.db'}"
    t0 = time.monotonic()
    r = tune(s, db, settings=Settings(data_dir=data))
    r["bench_wall"] = time.monotonic() - t0
    r["spec"], r["db"] = s, db
    trials = Store(db).trials(r["job_id"])
    r["probe_seconds"] = sum((t.finished_at - t.started_at).total_seconds() for t in trials
                             if t.role == "probe" and t.started_at and t.finished_at)
    r["busy"] = statistics.mean(b for t in trials if (b := (timing_of(t.result).get("interference") or {})
                                                      .get("others_busy_cores")) is not None)
    return r


def remeasure(entries: dict[str, tuple[dict, tuple[int, int, int]]], rounds: int, min_time: float) -> dict:
    """Each named (spec, config) measured `rounds` times, interleaved, the order reversed every other round;
    a config two names share is measured once a round."""
    from sltune.profiling import run_trial
    from sltune.profiling.timing import step_tokens_per_s, timing_of
    from sltune.tuning.search.trials import trial_spec
    from sltune.tuning.space import Candidate
    from sltune.tuning.spec import TuningSpec

    configs = {key: trial_spec(TuningSpec.parse(s), Candidate(*key), None).model_copy(
        update={"profile": False, "min_time_s": min_time, "timeout_s": 900}) for s, key in entries.values()}
    steps: dict[tuple, list[list[float]]] = {key: [] for key in configs}
    busy: list[float] = []
    order = list(configs)
    for r in range(rounds):
        for key in (order if r % 2 == 0 else order[::-1]):
            res = run_trial(configs[key]).model_dump(mode="json")
            steps[key].append(step_tokens_per_s(res) or [0.0])
            busy.append((timing_of(res).get("interference") or {}).get("others_busy_cores") or 0.0)
    return {"steps": {name: steps[key] for name, (_, key) in entries.items()}, "busy": busy}


def probes_error(r: dict, grid: dict) -> dict[str, tuple[float, float, int]]:
    """The job's probes' own fits (its probe trials alone, at the depth they ran) against every full-depth trial
    of the grid: per model, the median and largest relative error and the trials counted."""
    from sltune.store import Store
    from sltune.tuning.cost.shape import shape_of
    from sltune.tuning.space import Candidate, SearchSpace
    from sltune.tuning.spec import TuningSpec
    from sltune.tuning.search.state import FinishedTrial, SearchState

    spec = TuningSpec.parse(r["spec"])
    shape = shape_of(spec.model.source, spec.model.dtype)
    state = SearchState(spec, shape, SearchSpace(spec, shape))
    probes = [FinishedTrial(t.number, Candidate.from_knobs(t.config), t.role, t.result)
              for t in Store(r["db"]).trials(r["job_id"]) if t.role == "probe" and t.status == "ok"]
    state.history = probes
    if spec.search.probe_layers == "auto" and any(not state.reduced(d) for d in probes):
        probes = [d for d in probes if not state.reduced(d)]       # auto chose the whole model
    out = {}
    for kind, fit in state.fit(probes).items():
        errs = [abs(p / t.result[fit.target] - 1) for t in Store(grid["db"]).trials(grid["job_id"])
                if t.status == "ok" and t.role != "confirm"
                and (p := fit.predict(state.vars(Candidate.from_knobs(t.config)))) is not None]
        if errs:
            out[kind] = (statistics.median(errs), max(errs), len(errs))
    return out


def probe_cost(r: dict, rounds: int) -> list[float]:
    """The job's probes at reduced depth run again beside their whole-model selves, interleaved (reduced then whole,
    whole then reduced, ...): per round, their wall time at reduced depth over at full depth. Jobs run one after
    the other see different loads; this pairs each probe with its full-depth twin under the same one."""
    from sltune.profiling import run_trial
    from sltune.store import Store
    from sltune.tuning.search.trials import trial_spec
    from sltune.tuning.space import Candidate
    from sltune.tuning.spec import TuningSpec

    spec = TuningSpec.parse(r["spec"])
    probes = [(Candidate.from_knobs(t.config), t.config["num_layers"]) for t in Store(r["db"]).trials(r["job_id"])
              if t.role == "probe" and t.status == "ok" and t.config.get("num_layers")]
    ratios = []
    for i in range(rounds if len(probes) > 1 else 0):
        spent = {True: 0.0, False: 0.0}
        for c, layers in probes:
            for reduced in ((True, False) if i % 2 == 0 else (False, True)):
                t0 = time.monotonic()
                run_trial(trial_spec(spec, c, None, layers=layers if reduced else None))
                spent[reduced] += time.monotonic() - t0
        ratios.append(spent[True] / spent[False])
    return ratios


def main() -> None:
    from noise import label, pick       # bench/noise.py, beside this file

    from sltune.profiling.stats import paired_ratio_ci

    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=96)
    ap.add_argument("--device-limit", default="150MiB")
    ap.add_argument("--min-time", type=float, default=2.0, help="search.trial_min_time_s of every job")
    ap.add_argument("--repeats", type=int, default=2, help="oneshot jobs of each kind, full depth and auto "
                                                           "alternating (A B B A ...)")
    ap.add_argument("--rounds", type=int, default=4, help="interleaved rounds of the re-measurement")
    ap.add_argument("--remeasure-time", type=float, default=4.0, help="min_time_s of each re-measurement trial")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="sltune-depth-bench-"))
    print(f"bench/depth.py: 16 layers of llama-small's widths, seq {args.seq}, device limit {args.device_limit} "
          f"(data in {root})", flush=True)

    jobs = {"grid": run_job(spec(args, "grid", "grid"), root)}
    for i in range(args.repeats):
        for kind in (("full", "auto") if i % 2 == 0 else ("auto", "full")):
            jobs[f"oneshot {kind} {i}"] = run_job(spec(args, f"oneshot-{kind}-{i}", "oneshot",
                                                       "auto" if kind == "auto" else None), root)
    for name, r in jobs.items():
        search = [t for t in r["trials"] if t["role"] != "confirm"]
        print(f"{name:<15} {len(search):>2} search + {len(r['trials']) - len(search)} confirm trials, "
              f"{r['bench_wall']:5.0f}s, probes {r['probe_seconds']:4.0f}s; pick {label(pick(r))} "
              f"{r['best']['tokens_per_s']:,.1f} tokens/s; others busy {r['busy']:.2f} cores on average", flush=True)
        print(f"                stop: {r['stop_reason']}")
    ratios = []
    for i in range(args.repeats):
        full, auto = jobs[f"oneshot full {i}"], jobs[f"oneshot auto {i}"]
        depth = auto.get("depth") or {}
        step = depth.get("first_probe_full_depth_step_s")
        ratios.append(auto["probe_seconds"] / full["probe_seconds"])
        print(f"auto {i}: {'reduced' if depth.get('reduced') else 'the whole model'}; probes ran at "
              f"{depth.get('probes_ran_at')} of {depth.get('layers')} layers"
              + (f" (the first probe put a whole-model step at {step:.2f}s at most)" if step is not None else "")
              + f"; probe time {auto['probe_seconds']:.0f}s against the full-depth job's {full['probe_seconds']:.0f}s:"
              f" {ratios[-1]:.1%}")
        for kind, m in auto["models"].items():
            err = m.get("full_depth_error")
            loo = m.get("loo_typical_error")
            print(f"  model {kind}: leave-one-out {'-' if loo is None else f'{loo:.1%}'} typical; " + (
                f"the probes' fit at full depth: {err['typical']:.1%} typical, {err['max']:.1%} max, bias "
                f"{err['bias']:+.1%} over {err['n']} full-depth trials" if err else "no full-depth error"))
        for name in (f"oneshot auto {i}", f"oneshot full {i}"):
            errs = probes_error(jobs[name], jobs["grid"])
            counted = max(e[2] for e in errs.values())
            print(f"  {name}'s probes' fits against the grid's full-depth trials: " + ", ".join(
                f"{kind} {e[0]:.1%} typical, {e[1]:.1%} max" for kind, e in errs.items()) + f" ({counted} trials)")
    print(f"probe time within the jobs, auto over full depth (each job saw its own load): "
          f"{', '.join(f'{x:.1%}' for x in ratios)}", flush=True)
    paired = probe_cost(jobs["oneshot auto 0"], args.rounds)
    if paired:
        print(f"probe time paired (auto 0's probes at reduced and at full depth, interleaved, {len(paired)} rounds): "
              f"{', '.join(f'{x:.1%}' for x in paired)}; median {statistics.median(paired):.1%} (target <= 35%)",
              flush=True)

    m = remeasure({name: (r["spec"], pick(r)) for name, r in jobs.items()}, args.rounds, args.remeasure_time)
    grid = m["steps"]["grid"]
    for name, rounds in m["steps"].items():
        medians = [statistics.median(s) for s in rounds]
        line = (f"re-measured {name:<15} {label(pick(jobs[name]))}: {statistics.median(medians):,.1f} tokens/s "
                f"[{min(medians):,.1f}, {max(medians):,.1f}] over {len(rounds)} rounds")
        if name != "grid":
            r, (lo, hi) = paired_ratio_ci(rounds, grid)
            line += f"; {r:.3f}x [{lo:.3f}, {hi:.3f}] the grid's best" + (" (target >= 0.95)" if "auto" in name else "")
        print(line)
    print(f"others busy during the re-measurement: {statistics.mean(m['busy']):.2f} cores on average "
          f"(max {max(m['busy']):.2f}) of this machine's cores")


if __name__ == "__main__":
    main()
