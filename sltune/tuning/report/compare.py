"""Two jobs compared with statistics: is the newer one slower, beyond the allowed drop and beyond noise?

What `sltune compare` and /dashboard/compare promise: a regression is flagged only when the 95% interval
of the ratio of the two jobs' best throughputs (new / old) lies wholly below 1 - max_regression. An
interval that reaches above that line is "within noise" and passes. Every config both jobs measured is
listed with its ratio and interval. A config is its backend too (issue #33): SpeedLoader's b=4 N=2 and DeepSpeed's
b=4 N=2 are two rows, never pooled; a trial stored before there were backends ran SpeedLoader.

The intervals hold the noise within each job, not a change of the machine between the two: a best measured
beside a busy process and one measured on a quiet machine differ by the machine (one such pair in ten ran
0.76x "slower" quiet than beside the hog, in bench/noise.py (b)). Each trial records the cores other
processes kept busy; when the two bests' differ by CONFOUNDING_CORES or more, the jobs' trials cannot tell
the code from the machine and the verdict is "inconclusive" (exit code 0), naming both figures and
pointing to --remeasure.

Each side's samples are every timed step of every trial of that config (search and confirmation trials
alike), bootstrapped trial by trial and then step by step (sltune.profiling.stats), so a job whose trials
disagree with each other gets a wide interval, as it should. `remeasure` runs both bests again here,
interleaved round by round under the same conditions, and decides on the paired ratio instead: the
decisive answer when the two jobs ran at different times on a noisy machine.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from statistics import median
from typing import Any, Callable

from sltune.backend_knobs import ALL_KNOBS, BACKENDS, knobs_of
from sltune.backend_knobs import DEFAULTS as BACKEND_DEFAULTS
from sltune.backend_knobs import KNOBS as BACKEND_KNOBS
from sltune.config import RuntimeKnobs
from sltune.profiling.schema import SPEEDLOADER_ONLY
from sltune.profiling.stats import paired_ratio_ci, ratio_ci
from sltune.profiling.timing import step_tokens_per_s, timing_of
from sltune.tuning.report.throughput import median_of

Key = tuple
CONFOUNDING_CORES = 0.5     # a difference in other processes' busy cores that makes two measurements incomparable
# what a config is keyed on: the knobs a search sweeps (b, N, k, activations, ...), then the backend and every
# backend's own knobs (deepspeed's zero_stage, ...; fsdp's cpu_offload, ...), in the backends' order
KNOBS = (*(name for name, knob in knobs_of(RuntimeKnobs).items() if knob.searched), "backend", *ALL_KNOBS)
# what trials stored before a knob existed ran: recompute, no weights kept on the device, the optimizer in host
# memory (a host config's knobs leave optimizer_offload out), SpeedLoader (before there were backends)
BEFORE_KNOB = {"activations": "recompute", "weights_on_device": 0.0, "optimizer_offload": "host",
               "param_offload": "host", "backend": "speedloader"}
# SpeedLoader's own knobs among them, which another backend does not have (its trials store None, or nothing)
SPEEDLOADER_KNOBS = tuple(k for k in KNOBS if k in SPEEDLOADER_ONLY)


def backend_of(config: dict[str, Any]) -> str:
    """The backend a config ran on: speedloader for configs from before there were backends."""
    return str(config.get("backend") or "speedloader")


def normalized(config: dict[str, Any]) -> dict[str, Any]:
    """A config's KNOBS, filled in alike whoever stored it: BEFORE_KNOB's values for knobs it predates, its
    backend's defaults for that backend's knobs it leaves out, None for knobs its backend does not have (so a
    deepspeed config that stored num_live_blocks and one that did not are one config)."""
    backend = backend_of(config)
    out: dict[str, Any] = {}
    for k in KNOBS:
        if k == "backend":
            out[k] = backend
        elif k in ALL_KNOBS:
            own = k in BACKEND_KNOBS.get(backend, ())
            out[k] = (BACKEND_DEFAULTS[k] if config.get(k) is None else config[k]) if own else None
        elif k in SPEEDLOADER_KNOBS and backend != "speedloader":
            out[k] = None
        else:
            out[k] = config.get(k, BEFORE_KNOB.get(k))
    return out


def _key(config: dict[str, Any]) -> Key:
    """A config's knobs as a key (normalized()): configs of two backends never share one."""
    return tuple(normalized(config).values())


def _order(key: Key) -> tuple:
    """Rows in the backends' order, then by their knobs (None, a knob the backend lacks, last: never compared
    with a number)."""
    c = dict(zip(KNOBS, key))
    rank = BACKENDS.index(c["backend"]) if c["backend"] in BACKENDS else len(BACKENDS)
    return (rank, c["backend"], *((v is None, 0 if v is None else v) for v in key))


def trial_config(trial: dict[str, Any]) -> dict[str, Any]:
    """A trial's knobs with its backend's: the stored config, plus the backend and its knobs from the result's
    config where the stored one does not name them (the result's config is what the trial ran)."""
    config = dict(trial.get("config") or {})
    ran = (trial.get("result") or {}).get("config") or {}
    if "backend" not in config and ran.get("backend"):
        config["backend"] = ran["backend"]
        config.update({k: ran[k] for k in BACKEND_KNOBS.get(ran["backend"], ()) if k not in config and k in ran})
    return config


def knob_value(v: Any) -> str:
    """A knob's value as a spec writes it: true/false for a flag."""
    return str(v).lower() if isinstance(v, bool) else f"{v:g}" if isinstance(v, float) else str(v)


def backend_name(config: dict[str, Any]) -> str:
    """'deepspeed zero_stage=3 offload_optimizer=cpu offload_param=none': the backend and its own knobs (its
    defaults where the config leaves one out); 'speedloader' for SpeedLoader, whose knobs are b, N and k."""
    c = normalized(config)
    return " ".join([c["backend"], *(f"{k}={knob_value(c[k])}" for k in BACKEND_KNOBS.get(c["backend"], ()))])


def config_name(config: dict[str, Any]) -> str:
    """'b=4 N=2 k=1 optimizer_offload=disk': a compared config named as the tuner names its candidates
    (Candidate), without the knobs a row fills in for trials from before them where the mode has no such knob (a
    share kept on the device is generation's, beside its KV cache). Another backend's config leads with its name
    and ends with its knobs: 'deepspeed b=4 N=2 zero_stage=3 offload_optimizer=cpu offload_param=none'."""
    from sltune.tuning.space import Candidate     # here, not at import: compare stays light (no Optuna)

    backend = backend_of(config)
    if backend != "speedloader":
        c = normalized(config)
        return " ".join([backend, f"b={c['sub_batch_size']} N={c['num_sub_batches']}",
                         *([] if c["activations"] in (None, "recompute") else [str(c["activations"])]),
                         *(f"{k}={knob_value(c[k])}" for k in BACKEND_KNOBS.get(backend, ()))])
    knobs = {k: v for k, v in config.items() if v is not None and k != "backend"}
    if "kv_cache" not in knobs:
        knobs.pop("weights_on_device", None)
    return str(Candidate.from_knobs(knobs))


@dataclass
class JobData:
    """What a comparison needs of a job: its spec, its result (for the best) and its trials (as the API's
    GET /jobs/{id}/trials gives them)."""

    id: str
    status: str
    spec: dict[str, Any]
    best: dict[str, Any] | None
    trials: list[dict[str, Any]] = field(default_factory=list)


def from_store(store, job_id: str) -> JobData:
    job = store.job(job_id)
    if job is None:
        raise ValueError(f"no job {job_id!r} in {store.url}")
    trials = [{"number": t.number, "role": t.role, "status": t.status, "config": t.config, "result": t.result}
              for t in store.trials(job_id)]
    return JobData(job.id, job.status, job.spec, (job.result or {}).get("best"), trials)


def from_server(client, job_id: str) -> JobData:
    job = client.job(job_id)
    return JobData(job["id"], job["status"], job["spec"], job.get("best"), client.trials(job_id))


def samples(trial: dict[str, Any]) -> list[float] | None:
    """Tokens/s of every timed step of an ok trial (as GET /jobs/{id}/trials gives it)."""
    return step_tokens_per_s({**(trial.get("result") or {}), "status": trial.get("status")})


def by_config(job: JobData) -> dict[Key, list[list[float]]]:
    """Each config's trials' step samples; a probe at reduced depth (its stored config names num_layers) measured
    a smaller model, not the config, and is left out."""
    out: dict[Key, list[list[float]]] = {}
    for t in job.trials:
        if (t.get("config") or {}).get("num_layers") is not None:
            continue
        s = samples(t)
        if s:
            out.setdefault(_key(trial_config(t)), []).append(s)
    return out


def _median(groups: list[list[float]]) -> float:
    """A config's figure: the one a job reports as its best (sltune.tuning.report.throughput), so both say the same."""
    return median_of(groups)


def best_key(job: JobData, configs: dict[Key, list[list[float]]]) -> Key | None:
    """The job's own pick (its confirmed best), else the config with the highest median. A best whose config does
    not name its backend is its trial's (whose result does)."""
    if job.best and job.best.get("config"):
        config = job.best["config"]
        pick = next((t for t in job.trials if t.get("number") == job.best.get("trial_number")), None)
        if "backend" not in config and pick is not None:
            config = {**trial_config(pick), **config}
        key = _key(config)
        if key in configs:
            return key
    return max(configs, key=lambda k: _median(configs[k]), default=None)


def busy_elsewhere(job: JobData, key: Key) -> float | None:
    """The cores other processes kept busy, on average, while the job measured this config (None: never
    recorded, as by trials older than the record)."""
    seen = [busy for t in job.trials if _key(trial_config(t)) == key
            if (busy := (timing_of(t.get("result")).get("interference") or {}).get("others_busy_cores")) is not None]
    return sum(seen) / len(seen) if seen else None


def confounded(old: JobData, key_a: Key, new: JobData, key_b: Key) -> list[float] | None:
    """Both sides' busy cores elsewhere when they differ by CONFOUNDING_CORES or more, else None."""
    a, b = busy_elsewhere(old, key_a), busy_elsewhere(new, key_b)
    return [a, b] if a is not None and b is not None and abs(a - b) >= CONFOUNDING_CORES else None


def verdict(ci: tuple[float, float], max_regression: float, busy: list[float] | None = None) -> str:
    """What an interval of new/old says, against the allowed drop; inconclusive when the two sides were
    measured under different interference (`busy`, from confounded())."""
    if busy is not None:
        return "inconclusive"
    lo, hi = ci
    if hi < 1.0 - max_regression:
        return "regression"
    if lo > 1.0:
        return "faster"
    if lo >= 1.0 - max_regression:
        return "no regression"
    return "within noise"


def compare(old: JobData, new: JobData, max_regression: float = 0.05) -> dict[str, Any]:
    """Per-config ratios with intervals, and the verdict on the two bests. Raises ValueError (exit code 2)
    when there is nothing to compare."""
    for job in (old, new):
        if job.status in ("queued", "running"):
            raise ValueError(f"job {job.id} is {job.status}; compare finished jobs")
    a, b = by_config(old), by_config(new)
    rows = []
    for key in sorted(set(a) | set(b), key=_order):     # a config of one backend is never pooled with another's
        row: dict[str, Any] = {"config": dict(zip(KNOBS, key)), "a": _median(a[key]) if key in a else None,
                               "b": _median(b[key]) if key in b else None, "ratio": None, "ci95": None}
        if key in a and key in b:
            row["ratio"], ci = ratio_ci(b[key], a[key])
            row["ci95"] = list(ci)
            row["verdict"] = verdict(ci, max_regression, confounded(old, key, new, key))
        rows.append(row)
    ka, kb = best_key(old, a), best_key(new, b)
    if ka is None or kb is None:
        which = old.id if ka is None else new.id
        raise ValueError(f"job {which} has no successful trial: nothing to compare")
    ratio, ci = ratio_ci(b[kb], a[ka])
    busy = confounded(old, ka, new, kb)
    unstable = [f"{job.id} {config_name(dict(zip(KNOBS, key)))}" for job, key in ((old, ka), (new, kb))
                if any(timing_of(t.get("result")).get("unstable") for t in job.trials
                       if _key(trial_config(t)) == key)]
    return {"old": old.id, "new": new.id, "max_regression": max_regression, "rows": rows,
            "best_a": _median(a[ka]), "best_b": _median(b[kb]),
            "best_config_a": dict(zip(KNOBS, ka)), "best_config_b": dict(zip(KNOBS, kb)),
            "ratio": ratio, "ci95": list(ci), "change": ratio - 1.0,
            "verdict": verdict(ci, max_regression, busy), "measured_under_interference": unstable,
            "busy_elsewhere": busy, "remeasured": None}


def remeasure(cmp: dict[str, Any], old: JobData, new: JobData, rounds: int = 3,
              run: Callable[[Any], dict[str, Any]] | None = None) -> dict[str, Any]:
    """Both bests run again here, interleaved (old new, new old, ...), each with its own job's spec (so a
    difference in, say, hardware.cpu_threads stays); the verdict becomes the paired one. `run` takes a
    TrialSpec and returns a TrialResult dict (run_trial's by default)."""
    from sltune.profiling import run_trial
    from sltune.tuning.search.trials import trial_spec
    from sltune.tuning.space import Candidate
    from sltune.tuning.spec import TuningSpec

    run = run or (lambda spec: run_trial(spec).model_dump(mode="json"))
    got: dict[str, list[list[float]]] = {"old": [], "new": []}
    bests = {side: (TuningSpec.model_validate(job.spec), Candidate.from_knobs(cfg))
             for side, job, cfg in (("old", old, cmp["best_config_a"]), ("new", new, cmp["best_config_b"]))}
    # a best of optimizer_offload disk keeps its files here while it is measured, a fresh folder each run
    with tempfile.TemporaryDirectory(prefix="sltune-compare-") as scratch:
        for r in range(rounds):
            for side in (("old", "new") if r % 2 == 0 else ("new", "old")):
                tuning, cand = bests[side]
                folder = Path(scratch, f"{side}-{r}") if cand.uses_disk else None
                if folder is not None:
                    folder.mkdir()
                result = run(trial_spec(tuning, cand, None, offload_dir=folder).model_copy(update={"profile": False}))
                s = step_tokens_per_s(result)
                if s is None:
                    raise ValueError(f"re-measuring the {side} best failed: {result.get('status')}: "
                                     f"{result.get('error')}")
                got[side].append(s)
    ratio, ci = paired_ratio_ci(got["new"], got["old"])
    out = {**cmp, "ratio": ratio, "ci95": list(ci), "change": ratio - 1.0,
           "verdict": verdict(ci, cmp["max_regression"]),
           "remeasured": {"rounds": rounds, "old_round_medians": [median(g) for g in got["old"]],
                          "new_round_medians": [median(g) for g in got["new"]],
                          "from_jobs": {"ratio": cmp["ratio"], "ci95": cmp["ci95"], "verdict": cmp["verdict"]}}}
    out["best_a"], out["best_b"] = _median(got["old"]), _median(got["new"])
    return out


def exit_code(cmp: dict[str, Any]) -> int:
    """0 no regression (including within noise), 1 regression; errors are 2 (raised as ValueError)."""
    return 1 if cmp["verdict"] == "regression" else 0


def summary(cmp: dict[str, Any]) -> str:
    lo, hi = cmp["ci95"]
    how = (f"re-measured here, {cmp['remeasured']['rounds']} interleaved rounds, paired"
           if cmp.get("remeasured") else "from the jobs' trials")
    text = (f"best: {cmp['best_a']:,.1f} -> {cmp['best_b']:,.1f} tokens/s: {cmp['ratio']:.3f}x "
            f"[{lo:.3f}, {hi:.3f}] ({how}); allowed drop {cmp['max_regression']:.1%}: {cmp['verdict'].upper()}")
    if cmp["verdict"] == "within noise":
        text += " (the interval reaches above the allowed drop: not a significant regression)"
    if cmp["verdict"] == "inconclusive":
        a, b = cmp["busy_elsewhere"]
        text += (f" (other processes kept {a:.2f} cores busy while the old best was measured, {b:.2f} while the "
                 "new one was: the jobs' trials cannot tell the code from the machine; run compare --remeasure "
                 "for a side-by-side answer)")
    if cmp.get("measured_under_interference") and not cmp.get("remeasured"):
        text += ("\nnote: measured under interference: " + "; ".join(cmp["measured_under_interference"])
                 + " (use --remeasure for a side-by-side answer)")
    return text
