"""Issue #33 item 7: the tuned pick over all backends (speedloader, deepspeed, fsdp) against an exhaustive grid over
the same union, and each backend's best against the others, in one interleaved run per model.

    python bench/backends.py [--models llama-small,qwen2-0.5b] [--reps 2] [--strategy oneshot] [--max-trials N]
                             [--seq-len 64] [--layers 4] [--sub-batch-sizes 1,2,4] [--num-sub-batches 1,2,4]
                             [--trial-time 2] [--rounds 5] [--remeasure-time 2]
                             [--activations recompute[,offload]] [--regime-num-sub-batches 16] [--quick]

The shapes run (float32 weights with AdamW, seq --seq-len, one rank, every core, no device memory limit):
- llama-small: the preset as it is (8 layers, hidden 512, 8 heads, MLP 1408, vocab 8192; ~34M parameters);
- qwen2-0.5b: its widths (hidden 896, 14 heads, 2 KV heads, MLP 4864, vocab 151936, tied embeddings, attention
  biases) at --layers decoder layers, 4 by default (~196M parameters; 0 runs all 24, ~494M: about 8 GB of
  model state a trial, and minutes a step on 2 cores). The reduced model is an inline config (model.hf_config with
  num_hidden_layers N): search.probe_layers, the spec's own depth reduction, is SpeedLoader's alone and refused
  for a job over several backends, and every trial of both jobs and of the re-measurement runs this same model.
- --quick: llama-tiny (4 layers, hidden 64) over a tiny grid, one rep, short timing: a smoke run of a few minutes.

The union searched (each knob's values apply to every backend unless named): sub_batch_size b {1, 2, 4},
num_sub_batches N {1, 2, 4}; speedloader num_live_blocks k {1, 2}; deepspeed zero_stage {2, 3} x offload_optimizer
{none, cpu} x offload_param {none, cpu} (offload_param cpu at ZeRO-3 only: 6 variants); fsdp cpu_offload
{false, true}: 9 x (2 + 6 + 2) = 90 configs (--quick: b {1}, N {2}: 10; --sub-batch-sizes and --num-sub-batches
narrow b and N, e.g. 1,4 and 2,4: 40 configs). The tuned job's max_trials defaults to
24 (its confirmation trials come on top, as they do for the grid's); the grid runs every config.

Per model and rep, the grid job and the tuned job run one after the other, alternating which goes first, each in
its own SQLite database; each prints its trials (search + confirm), wall time, pick and tokens/s, and any trial
that was not ok with its reason (a diverged trial is never picked, nor pooled below). Then, from the grid's trials (all
reps pooled, each config at the median of its ok trials): each backend's best (the config the grids'
best_by_backend named most often), the best ZeRO-3 offload config (zero_stage 3, offload_optimizer cpu,
offload_param cpu), the best ZeRO-2 config and SpeedLoader's best, those three at the smallest sub_batch_size
(the paper's small-sub-batch regime), and beside them the ceiling: SpeedLoader's b, N and k there on the resident
schedule (every weight, gradient and optimizer state where it computes: nothing copied, nothing offloaded, PyTorch's
own step), the most any runtime that moves weights could reach on this machine. The paper's regime is many small
sub-batches, more than the union's N: at each --regime-num-sub-batches N (16 by default) every union config of those
three systems at the smallest b runs again at that N, with the ceiling, and each system's best there is the one with
the highest median in the re-measurement itself. Every one of these configs, and
each rep's tuned and grid picks, is then
re-measured side by side with run_trial (no profiled step, --remeasure-time seconds of timed steps), interleaved
A B C ..., the order reversed every other round, --rounds rounds. Ratios are per round (the same round's two
trials), as median [min, max]; tokens/s and peak host memory likewise over the rounds.

Goals (from the measured ratios): the pick >= 0.95x the grid's best (per rep and round, median); the tuned job's
trials <= 35% of the grid's (per rep, median; confirmation trials counted in both); at the smallest sub_batch_size
SpeedLoader's best >= 2x the best ZeRO-3 offload config and >= 1.5x the best ZeRO-2 config (median per-round
ratios), over the union's N and at each regime N. The last line is one JSON object with every figure.

Time (measured while writing this, on the 2-core machine with another test run beside it, others keeping about 1.4
cores busy): a llama-small trial took 10-16 s at b=1 N=2 (so a 90-config grid is roughly 20-30 min, and
llama-small's two reps with its re-measurement about an hour); qwen2-0.5b's widths took 65-90 s a trial at 2 layers
and b=1 N=2, and 205 s at 4 layers and b=4 N=4 (steps of 20-45 s: its 151936-token head and the AdamW step over
its 136M-parameter embedding dominate whatever the depth), so its two reps take several hours. For less:
--models llama-small, --reps 1, --seq-len 32, or --layers 2 (the head and embedding stay; only the layers' share
shrinks). --quick took 1.5-2.5 minutes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

# sltune is imported inside the functions: a trial process (forked from the fork server) imports this file again
# as its main module, and needs none of it

QWEN_LAYERS = 4
GRID = {"sub_batch_size": [1, 2, 4], "num_sub_batches": [1, 2, 4], "num_live_blocks": [1, 2]}
QUICK_GRID = {"sub_batch_size": [1], "num_sub_batches": [2], "num_live_blocks": [1, 2]}
BACKENDS = ["speedloader", "deepspeed", "fsdp"]
DEEPSPEED = {"zero_stage": [2, 3], "offload_optimizer": ["none", "cpu"], "offload_param": ["none", "cpu"]}
FSDP = {"cpu_offload": [False, True]}
GOALS = {"pick": 0.95, "trials": 0.35, "zero3_offload": 2.0, "zero2": 1.5}
SYSTEMS = ("speedloader", "zero3 offload", "zero2")      # the small-sub-batch comparison's (regime_system)


def model_section(name: str, layers: int) -> tuple[dict[str, Any], str]:
    """The spec's model section, and what shape it is. qwen2-0.5b runs at `layers` decoder layers (0: all)."""
    from sltune.models.presets import PRESETS, param_count

    if name == "qwen2-0.5b" and layers:
        preset = PRESETS[name]
        cfg = {"model_type": preset.family, **preset.kwargs, "num_hidden_layers": layers}
        params = param_count(cfg)       # counted on the meta device (tied embeddings once)
        return {"hf_config": cfg}, f"qwen2-0.5b's widths at {layers} of 24 layers (~{params / 1e6:.0f}M parameters)"
    if name not in PRESETS:
        raise SystemExit(f"no preset {name!r}; choose from {', '.join(PRESETS)}")
    return {"preset": name}, f"{name} ({PRESETS[name].description})"


def job_spec(model: dict[str, Any], args, strategy: str, rep: int, tag: str) -> dict[str, Any]:
    grid = dict(QUICK_GRID if args.quick else GRID)
    for knob, values in (("sub_batch_size", args.sub_batch_sizes), ("num_sub_batches", args.num_sub_batches)):
        if values:
            grid[knob] = values
    return {"name": f"bench-backends-{tag}-{strategy}-{rep}", "model": model, "workload": {"seq_len": args.seq_len},
            "search": {"strategy": strategy, "backend": BACKENDS, **grid, "activations": args.activations,
                       "deepspeed": DEEPSPEED, "fsdp": FSDP,
                       "max_trials": 100_000 if strategy == "grid" else args.max_trials,
                       "trial_min_time_s": args.trial_time, "profile": False, "time_budget_s": 7 * 86400,
                       "trial_timeout_s": 1800, "seed": rep}}


def label(config: dict[str, Any]) -> str:
    from sltune.tuning.space import Candidate

    c = Candidate.from_knobs(config)
    return str(c) if c.backend != "speedloader" else f"speedloader {c}"


def key(config: dict[str, Any]):
    from sltune.tuning.space import Candidate

    return Candidate.from_knobs(config)


def run_key(config: dict[str, Any]):
    """What the re-measurement runs: the candidate, and (a config of SpeedLoader's resident schedule, the ceiling
    entry) its schedule beside it."""
    schedule = config.get("schedule") or "speedloader"
    return key(config) if schedule == "speedloader" else (key(config), schedule)


def run_label(config: dict[str, Any]) -> str:
    schedule = config.get("schedule") or "speedloader"
    return label(config) + ("" if schedule == "speedloader" else f" schedule={schedule}")


def spread(xs: list[float], fmt: str = "{:.2f}") -> str:
    if not xs:
        return "n/a"
    return f"{fmt.format(statistics.median(xs))} [{fmt.format(min(xs))}, {fmt.format(max(xs))}]"


def figures(xs: list[float]) -> dict[str, float] | None:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)} if xs else None


def run_job(spec: dict[str, Any], root: Path, who: str) -> dict[str, Any]:
    from sltune.service.local import tune
    from sltune.settings import Settings
    from sltune.store import Store

    data = root / spec["name"]
    url = f"sqlite:///{data / 'jobs.db'}"
    seen: set[int] = set()

    def progress(p: dict[str, Any]) -> None:
        last = p.get("last_trial")      # reported as it starts (running) and once it has finished
        if last and last["status"] != "running" and last["number"] not in seen:
            seen.add(last["number"])
            tps = last.get("tokens_per_s")
            print(f"    {who} trial {last['number']:>3} ({p.get('phase')}) {label(last['config']):<62} "
                  f"{last['status']:<8} {'' if tps is None else f'{tps:8.1f} tokens/s'}"
                  f"{'' if last['status'] == 'ok' else ' ' + str(last.get('error') or '')[:120]}", flush=True)

    t0 = time.monotonic()
    r = tune(spec, url, progress=progress, settings=Settings(data_dir=data))
    r["bench_wall"] = time.monotonic() - t0
    r["spec"] = spec
    r["rows"] = Store(url).trials(r["job_id"])
    return r


def report_job(model: str, rep: int, name: str, r: dict[str, Any]) -> None:
    confirms = sum(t["role"] == "confirm" for t in r["trials"])
    best = r["best"]
    pick = f"{label(best['config'])} {best['tokens_per_s']:.1f} tokens/s" if best else "no pick (no ok trial)"
    print(f"{model} rep {rep} {name:<8} {len(r['trials']) - confirms:>3} search + {confirms} confirm trials, "
          f"{r['bench_wall']:7.1f}s, stop: {r['stop_reason']}; pick {pick}", flush=True)
    for t in r["trials"]:
        if t["status"] != "ok":
            print(f"    not ok: trial {t['number']} {label(t['config'])}: {t['status']}: "
                  f"{str(t.get('error') or '')[:300]}", flush=True)


def pooled(grids: list[dict[str, Any]]) -> dict[Any, dict[str, Any]]:
    """Each config of the grids' ok trials (search and confirmation, every rep): its knobs and median tokens/s."""
    per: dict[Any, dict[str, Any]] = {}
    for g in grids:
        for t in g["rows"]:
            if t.status == "ok" and t.tokens_per_s:
                e = per.setdefault(key(t.config), {"config": t.config, "tps": []})
                e["tps"].append(t.tokens_per_s)
    return {k: {**e, "median": statistics.median(e["tps"])} for k, e in per.items()}


def best_of(configs: dict[Any, dict[str, Any]], keep) -> dict[str, Any] | None:
    chosen = [e for k, e in configs.items() if keep(k)]
    return max(chosen, key=lambda e: e["median"])["config"] if chosen else None


def regime_system(k) -> str | None:
    """Which of the small-sub-batch comparison's systems a candidate is: speedloader, zero2, zero3 offload."""
    if k.backend == "speedloader":
        return "speedloader"
    if k.backend == "deepspeed" and k.zero_stage == 2:
        return "zero2"
    if k.backend == "deepspeed" and k.zero_stage == 3 and k.offload_optimizer == "cpu" and k.offload_param == "cpu":
        return "zero3 offload"
    return None


def entries_of(grids: list[dict[str, Any]], tuned: list[dict[str, Any]],
               regime_ns: list[int]) -> tuple[dict[str, dict], int]:
    """What the re-measurement compares: name -> config; and the smallest sub_batch_size."""
    configs = pooled(grids)
    b_min = min(k.sub_batch_size for k in configs) if configs else 1
    out: dict[str, dict[str, Any]] = {}
    for rep, (g, t) in enumerate(zip(grids, tuned)):
        if g["best"]:
            out[f"grid pick rep {rep}"] = g["best"]["config"]
        if t["best"]:
            out[f"tuned pick rep {rep}"] = t["best"]["config"]
    for backend in BACKENDS:
        named = Counter(key(g["best_by_backend"][backend]["config"]) for g in grids
                        if backend in (g.get("best_by_backend") or {}))
        if named:
            top = max(named.values())
            winner = max((k for k, n in named.items() if n == top),
                         key=lambda k: configs[k]["median"] if k in configs else 0.0)
            out[f"{backend} best"] = next(g["best_by_backend"][backend]["config"] for g in grids
                                          if key(g["best_by_backend"][backend]["config"]) == winner)
    for system in SYSTEMS:
        c = best_of(configs, lambda k: k.sub_batch_size == b_min and regime_system(k) == system)
        if c is not None:
            out[f"{system} best at b={b_min}"] = c
    sl_min = out.get(f"speedloader best at b={b_min}")
    for n in regime_ns:
        # the paper's regime: b_min with many sub-batches, beyond the union's N. Every union config of each system
        # at b_min (SpeedLoader's k, ZeRO-2's offload, ZeRO-3 offload) runs again at N=n; each system's best is
        # taken from the re-measurement itself
        for k, e in configs.items():
            system = regime_system(k)
            if k.sub_batch_size == b_min and system:
                c = {**e["config"], "num_sub_batches": n}
                out[f"{system} at b={b_min} N={n}: {label(c)}"] = c
        if sl_min is not None:
            out[f"resident at b={b_min} N={n}"] = {**sl_min, "num_sub_batches": n, "schedule": "resident",
                                                   "optimizer_offload": "host"}
    if sl_min is not None:
        # the ceiling on this machine: the same b, N and k with every weight, gradient and optimizer state resident
        # (nothing copied or offloaded; PyTorch's own step on the model as it is), through the same trial harness
        out[f"resident at b={b_min}"] = {**sl_min, "schedule": "resident", "optimizer_offload": "host"}
    return out, b_min


def remeasure(model: str, spec: dict[str, Any], entries: dict[str, dict[str, Any]], args) -> dict[str, Any]:
    """Every distinct config of `entries` once a round, interleaved, the order reversed every other round."""
    from sltune.profiling import run_trial
    from sltune.profiling.timing import timing_of
    from sltune.tuning.search.trials import trial_spec
    from sltune.tuning.spec import TuningSpec

    ts = TuningSpec.parse(spec)
    configs = {run_key(c): c for c in entries.values()}
    distinct = list(configs)
    specs = {k: trial_spec(ts, key(c), None).model_copy(
        update={"profile": False, "min_time_s": args.remeasure_time, "timeout_s": 1800,
                **({"schedule": c["schedule"]} if isinstance(k, tuple) else {})}) for k, c in configs.items()}
    runs: dict[Any, list[dict[str, Any] | None]] = {k: [] for k in distinct}
    busy: list[float] = []
    for r in range(args.rounds):
        t0 = time.monotonic()
        line = []
        for k in (distinct if r % 2 == 0 else distinct[::-1]):
            res = run_trial(specs[k]).model_dump(mode="json")
            if res["status"] != "ok" or not res.get("tokens_per_s"):
                print(f"    round {r}: {run_label(configs[k])} {res['status']}: "
                      f"{str(res.get('error') or '')[:300]} (left out of this round)", flush=True)
                runs[k].append(None)
                continue
            runs[k].append(res)
            busy.append((timing_of(res).get("interference") or {}).get("others_busy_cores") or 0.0)
            line.append(f"{res['tokens_per_s']:.1f}")
        print(f"{model} re-measure round {r + 1}/{args.rounds}: {len(distinct)} configs in "
              f"{time.monotonic() - t0:.0f}s, tokens/s {' '.join(line)}", flush=True)
    return {"runs": runs, "busy": busy}


def ratios(runs: dict[Any, list], a: Any, b: Any) -> list[float]:
    """Per round: a's tokens/s over b's (rounds where both were ok)."""
    return [x["tokens_per_s"] / y["tokens_per_s"] for x, y in zip(runs[a], runs[b]) if x and y]


def goal(name: str, value: float | None, target: float, at_most: bool = False) -> dict[str, Any]:
    ok = value is not None and (value <= target if at_most else value >= target)
    return {"goal": name, "measured": value, "target": target, "pass": ok}


def bench_model(name: str, args, root: Path) -> dict[str, Any]:
    model, shape = model_section("llama-tiny" if args.quick else name, args.layers)
    tag = "quick" if args.quick else name
    spec0 = job_spec(model, args, "grid", 0, tag)
    from sltune.tuning.cost.shape import shape_of
    from sltune.tuning.space import SearchSpace
    from sltune.tuning.spec import TuningSpec

    ts = TuningSpec.parse(spec0)
    space = SearchSpace(ts, shape_of(ts.model.source, ts.model.dtype))
    per_backend = Counter(c.backend for c in space.candidates)
    print(f"\n== {shape}, seq {args.seq_len}, float32 + AdamW: union of {len(space.candidates)} configs "
          f"({', '.join(f'{b} {n}' for b, n in per_backend.items())}); {args.strategy} max_trials "
          f"{args.max_trials}, {args.reps} reps", flush=True)

    grids, tuned = [], []
    for rep in range(args.reps):
        order = ("grid", args.strategy) if rep % 2 == 0 else (args.strategy, "grid")
        for strategy in order:
            print(f"{tag} rep {rep}: {strategy} job starting", flush=True)
            r = run_job(job_spec(model, args, strategy, rep, tag), root, f"{strategy}/{rep}")
            (grids if strategy == "grid" else tuned).append(r)
            report_job(tag, rep, strategy, r)

    trial_ratio = [len(t["trials"]) / len(g["trials"]) for t, g in zip(tuned, grids) if g["trials"]]
    wall_ratio = [t["bench_wall"] / g["bench_wall"] for t, g in zip(tuned, grids)]
    print(f"{tag}: {args.strategy} over grid per rep: trials {spread(trial_ratio, '{:.3f}')}x "
          f"({spread([len(t['trials']) for t in tuned], '{:.0f}')} of "
          f"{spread([len(g['trials']) for g in grids], '{:.0f}')}), wall {spread(wall_ratio)}x", flush=True)

    entries, b_min = entries_of(grids, tuned, args.regime_num_sub_batches)
    for n, c in entries.items():
        print(f"  to re-measure: {n:<32} {run_label(c)}")
    m = remeasure(tag, spec0, entries, args)
    runs = m["runs"]
    k = {n: run_key(c) for n, c in entries.items()}
    configs_of = {run_key(c): c for c in entries.values()}

    per_entry = {}
    print(f"\n{tag} re-measured side by side ({args.rounds} rounds, {args.remeasure_time:g}s of timed steps each), "
          "median [min, max] over the rounds:")
    for n, c in entries.items():
        ok = [x for x in runs[k[n]] if x]
        tps = [x["tokens_per_s"] for x in ok]
        host = [x["peak_host_bytes"] / 2**30 for x in ok if x.get("peak_host_bytes")]
        ci = [x["timing"]["tokens_per_s_ci95"] for x in ok if x.get("timing")]
        per_entry[n] = {"config": run_label(c), "tokens_per_s": figures(tps), "peak_host_gib": figures(host),
                        "ok_rounds": len(ok), "rounds": len(runs[k[n]]),
                        "trial_ci95": ci}
        print(f"  {n:<32} {run_label(c):<62} {spread(tps, '{:.1f}'):>26} tokens/s, host peak "
              f"{spread(host)} GiB" + ("" if len(ok) == len(runs[k[n]]) else
                                      f" ({len(runs[k[n]]) - len(ok)} round(s) not ok)"))

    for n in args.regime_num_sub_batches:     # each system's best at b_min N=n, by its median over the rounds
        for system in SYSTEMS:
            prefix = f"{system} at b={b_min} N={n}: "
            medians = {name: per_entry[name]["tokens_per_s"]["median"] for name in entries
                       if name.startswith(prefix) and per_entry[name]["tokens_per_s"]}
            if medians:
                best = k[f"{system} best at b={b_min} N={n}"] = k[max(medians, key=medians.get)]
                print(f"  {system + f' best at b={b_min} N={n}':<32} {run_label(configs_of[best])}")
    # the small-sub-batch comparisons: at b_min over the union's N, then at each regime N
    scopes = [f"b={b_min}"] + [f"b={b_min} N={n}" for n in args.regime_num_sub_batches]

    pick_over_grid = [x for rep in range(args.reps) if f"tuned pick rep {rep}" in k and f"grid pick rep {rep}" in k
                      for x in ratios(runs, k[f"tuned pick rep {rep}"], k[f"grid pick rep {rep}"])]
    versus: dict[str, list[float]] = {}
    if "speedloader best" in k:
        for backend in BACKENDS[1:]:
            if f"{backend} best" in k:
                versus[f"speedloader best / {backend} best"] = ratios(runs, k["speedloader best"], k[f"{backend} best"])
    for scope in scopes:
        sl, ceiling = f"speedloader best at {scope}", f"resident at {scope}"
        for other in (f"zero3 offload best at {scope}", f"zero2 best at {scope}"):
            if sl in k and other in k:
                versus[f"{sl} / {other}"] = ratios(runs, k[sl], k[other])
            if ceiling in k and other in k:      # the most any schedule that moves weights could reach here
                versus[f"{ceiling} / {other}"] = ratios(runs, k[ceiling], k[other])
        if ceiling in k and sl in k:
            versus[f"{sl} / {ceiling}"] = ratios(runs, k[sl], k[ceiling])
    print(f"\n{tag} ratios per round, median [min, max]:")
    same_pick = sum(k.get(f"tuned pick rep {r}") == k.get(f"grid pick rep {r}") for r in range(args.reps))
    print(f"  {args.strategy} pick / grid pick (each rep's, per round): {spread(pick_over_grid, '{:.3f}')}"
          + (f"  ({same_pick} of {args.reps} reps picked the same config: 1 by construction)" if same_pick else ""))
    same = {f"{a} / {b}" for a in k for b in k if k[a] == k[b]}
    for n, xs in versus.items():
        print(f"  {n:<58} {spread(xs, '{:.3f}')}" + ("  (the same config)" if n in same else ""))
    details = {}        # what DeepSpeed and FSDP chose that their knobs do not say (DeepSpeed's optimizer, ...)
    for n in entries:
        for x in runs[k[n]]:
            if x and x.get("backend_detail"):
                details.setdefault(run_label(entries[n]), x["backend_detail"])
    for config, d in details.items():
        print(f"  {config} ran with {', '.join(f'{a} {b}' for a, b in d.items())}")
    busy = m["busy"]
    print(f"  others busy during the re-measurement: {statistics.mean(busy) if busy else 0:.2f} cores on average "
          f"(max {max(busy, default=0):.2f})")

    def med(xs: list[float]) -> float | None:
        return statistics.median(xs) if xs else None

    goals = [goal(f"{args.strategy} pick >= {GOALS['pick']}x the grid's best", med(pick_over_grid), GOALS["pick"]),
             goal(f"{args.strategy} trials <= {GOALS['trials']:.0%} of the grid's", med(trial_ratio), GOALS["trials"],
                  at_most=True)]
    for scope in scopes:
        for other, target in (("zero3 offload", GOALS["zero3_offload"]), ("zero2", GOALS["zero2"])):
            goals.append(goal(f"speedloader >= {target}x {other} at {scope}",
                              med(versus.get(f"speedloader best at {scope} / {other} best at {scope}", [])), target))
    print(f"\n{tag} goals:")
    for g in goals:
        v = "n/a" if g["measured"] is None else f"{g['measured']:.3f}"
        print(f"  {'PASS' if g['pass'] else 'FAIL'}  {g['goal']}: measured {v}")

    not_ok = [{"job": r["name"], "trial": t["number"], "config": label(t["config"]), "status": t["status"],
               "error": t.get("error")} for r in grids + tuned for t in r["trials"] if t["status"] != "ok"]
    return {"shape": shape, "seq_len": args.seq_len, "space_size": len(space.candidates),
            "space_by_backend": dict(per_backend),
            "jobs": [{"job": r["name"], "strategy": r["strategy"], "trials": len(r["trials"]),
                      "confirm_trials": sum(t["role"] == "confirm" for t in r["trials"]),
                      "wall_s": r["bench_wall"], "stop_reason": r["stop_reason"],
                      "pick": label(r["best"]["config"]) if r["best"] else None,
                      "pick_tokens_per_s": r["best"]["tokens_per_s"] if r["best"] else None,
                      "best_by_backend": {b: {"config": label(e["config"]), "tokens_per_s": e["tokens_per_s"]}
                                          for b, e in (r.get("best_by_backend") or {}).items()}}
                     for r in grids + tuned],
            "trials_over_grid": figures(trial_ratio), "wall_over_grid": figures(wall_ratio),
            "pick_over_grid": figures(pick_over_grid),
            "ratios": {n: figures(xs) for n, xs in versus.items()},
            "remeasured": per_entry, "others_busy_cores": figures(busy), "backend_detail": details,
            "same_pick_reps": same_pick,
            "not_ok_trials": not_ok, "goals": goals}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="llama-small,qwen2-0.5b", help="comma-separated presets")
    ap.add_argument("--reps", type=int, default=None, help="grid + tuned job pairs per model (default 2; --quick 1)")
    ap.add_argument("--strategy", default="oneshot", choices=["oneshot", "random", "tpe"])
    ap.add_argument("--max-trials", type=int, default=None, help="the tuned job's search.max_trials (default 24; "
                                                                  "--quick 10)")
    ap.add_argument("--seq-len", type=int, default=64)
    ints = lambda v: [int(x) for x in v.split(",")]  # noqa: E731
    ap.add_argument("--sub-batch-sizes", type=ints, default=None,
                    help="comma-separated b values of the union (default 1,2,4): fewer for a shorter run")
    ap.add_argument("--num-sub-batches", type=ints, default=None,
                    help="comma-separated N values of the union (default 1,2,4)")
    ap.add_argument("--layers", type=int, default=QWEN_LAYERS,
                    help=f"qwen2-0.5b's decoder layers (default {QWEN_LAYERS}; 0: all 24)")
    ap.add_argument("--trial-time", type=float, default=None,
                    help="both jobs' search.trial_min_time_s (default 2; --quick 0.3)")
    ap.add_argument("--rounds", type=int, default=None, help="re-measurement rounds (default 5; --quick 2)")
    ap.add_argument("--remeasure-time", type=float, default=None,
                    help="min_time_s of each re-measurement trial (default 2; --quick 0.5)")
    ap.add_argument("--activations", default="recompute", type=lambda v: v.split(","),
                    help="comma-separated: recompute (DeepSpeed and FSDP: gradient checkpointing), offload (no "
                         "recomputation); both doubles the union (default recompute)")
    ap.add_argument("--regime-num-sub-batches", type=lambda v: [int(x) for x in v.split(",") if x.strip()],
                    default=None, help="comma-separated N at which the smallest b's systems (SpeedLoader's k, ZeRO-2's "
                    "offload, ZeRO-3 offload, the ceiling) are re-measured beyond the union: the paper's regime of "
                    "many small sub-batches (default 16; --quick 4; '' for none)")
    ap.add_argument("--quick", action="store_true", help="llama-tiny, a 10-config union, one rep: a smoke run")
    args = ap.parse_args()
    q = args.quick
    for name, full, quick in (("reps", 2, 1), ("max_trials", 24, 10), ("trial_time", 2.0, 0.3), ("rounds", 5, 2),
                              ("remeasure_time", 2.0, 0.5), ("regime_num_sub_batches", [16], [4])):
        if getattr(args, name) is None:
            setattr(args, name, quick if q else full)
    models = ["llama-tiny"] if q else [m.strip() for m in args.models.split(",") if m.strip()]

    from sltune.profiling import forks
    from sltune.tuning.cost.baseline import trial_baseline

    root = Path(tempfile.mkdtemp(prefix="sltune-backends-bench-"))
    print(f"bench/backends.py: models {', '.join(models)}; data in {root}", flush=True)
    # what every job of this process shares, paid before the first: the trials' fork server and the trial baseline
    forks.start()
    trial_baseline("cpu", 1, "train")
    t0 = time.monotonic()
    out = {}
    for name in models:
        out[name] = bench_model(name, args, root)
    print(f"\ntotal {time.monotonic() - t0:.0f}s")
    print(json.dumps({"bench": "backends", "args": vars(args), "models": out}, default=str))


if __name__ == "__main__":
    main()
