"""Trials and fitted models as a real job of examples/tiny-llama-cpu.yaml measured them: the figures, the pages
and the browser test draw the same data; and the limits the figures draw beside it."""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone
from pathlib import Path

from sltune.tuning.search.fit import MODELS, LinearFit, variables
from sltune.tuning.cost.shape import shape_of
from sltune.tuning.space import Candidate

MEASURED_JOB = Path(__file__).with_name("three_backends_job.json")
# (number, role, status, b, N, k, tokens/s, device peak, host peak, (compute, memcpy, cpu, other)) as a real
# job of examples/tiny-llama-cpu.yaml measured them
ROWS = [
    (0, "probe", "ok", 1, 1, 1, 74.2, 1064452, 322760704, (0.710, 0.138, 0.085, 0.067)),
    (1, "probe", "ok", 1, 1, 4, 97.6, 3107332, 324595712, (0.843, 0.048, 0.101, 0.008)),
    (2, "probe", "ok", 4, 1, 1, 372.2, 2568196, 326525952, (0.811, 0.077, 0.073, 0.039)),
    (3, "probe", "oom", 4, 1, 4, None, 6323716, None, None),
    (4, "probe", "ok", 1, 4, 1, 218.8, 1172496, 323485696, (0.725, 0.087, 0.126, 0.062)),
    (5, "probe", "ok", 1, 4, 4, 168.7, 3215376, 325681152, (0.959, 0.010, 0.021, 0.010)),
    (6, "probe", "ok", 2, 1, 2, 198.0, 2778628, 325582848, (0.495, 0.093, 0.385, 0.027)),
    (7, "frontier", "ok", 4, 8, 2, 261.9, 5090336, 332496896, (0.847, 0.037, 0.106, 0.010)),
    (8, "frontier", "ok", 8, 8, 1, 1618.8, 5813792, 340676608, (0.876, 0.020, 0.091, 0.013)),
]


def _result(status, b, n, k, tps, dev, host, bd, seq_len=64):
    out = {"status": status, "error": None if status == "ok" else "device memory limit exceeded on cpu",
           "config": {"sub_batch_size": b, "num_sub_batches": n, "num_live_blocks": k, "schedule": "speedloader",
                      "seq_len": seq_len, "world_size": 1},
           "tokens_per_s": tps, "step_seconds": b * n * seq_len / tps if tps else None,
           "peak_device_bytes": dev, "peak_host_bytes": host, "breakdown": None}
    if bd is not None:
        compute, memcpy, cpu, other = bd
        out["breakdown"] = {"compute": compute, "memcpy": memcpy, "cpu": cpu, "all_gather": 0.0,
                            "reduce_scatter": 0.0, "other": other}
    return out


def realistic_trials(start: datetime | None = None) -> list[dict]:
    """Trials as GET /jobs/{id}/trials gives them."""
    t0 = start or datetime(2026, 1, 1, 12, 0, 0, tzinfo=timezone.utc)
    out = []
    for i, (num, role, status, b, n, k, tps, dev, host, bd) in enumerate(ROWS):
        out.append({"number": num, "role": role, "status": status,
                    "config": {"sub_batch_size": b, "num_sub_batches": n, "num_live_blocks": k,
                               "schedule": "speedloader"},
                    "predicted": ({"peak_device_bytes": dev * 1.08, "peak_host_bytes": None}
                                  if role == "frontier" else {}),
                    "result": _result(status, b, n, k, tps, dev, host, bd),
                    "started_at": t0 + timedelta(seconds=10 * i), "finished_at": t0 + timedelta(seconds=10 * i + 7),
                    "trace_url": f"/jobs/j/trials/{num}/trace" if status == "ok" else None})
    return out


def realistic_models(trials: list[dict]) -> dict:
    """The job's fitted models, fitted by sltune's own least squares on the ok trials (SpeedLoader's: the models
    are of its memory)."""
    out = {}
    for kind, (target, feats) in MODELS["train"].items():
        rows = []
        for t in trials:
            r = t["result"]
            if t["status"] != "ok" or r.get(target) is None \
                    or r["config"].get("backend", "speedloader") != "speedloader":
                continue
            rows.append((variables(Candidate.from_knobs(t["config"]), shape_of("llama-tiny"), 64), float(r[target])))
        out[kind] = LinearFit.fit(target, feats, rows).to_dict()
    return out


# (number, role, status, backend, its knobs, b, N, tokens/s, (compute, memcpy, cpu, all_gather, reduce_scatter,
# other), parity rel_diff) of one job over the three backends (issue #33), after ROWS' SpeedLoader trials
BACKEND_ROWS = [
    (9, "probe", "ok", "deepspeed", {"zero_stage": 2, "offload_optimizer": "cpu", "offload_param": "none"}, 4, 2,
     940.0, (0.52, 0.14, 0.21, 0.06, 0.05, 0.02), 0.0004),
    (10, "probe", "ok", "deepspeed", {"zero_stage": 3, "offload_optimizer": "cpu", "offload_param": "cpu"}, 4, 2,
     610.0, (0.41, 0.22, 0.18, 0.10, 0.07, 0.02), 0.0006),
    (11, "probe", "oom", "deepspeed", {"zero_stage": 2, "offload_optimizer": "none", "offload_param": "none"}, 8, 8,
     None, None, None),
    (12, "probe", "ok", "fsdp", {"cpu_offload": False, "reshard_after_forward": True}, 4, 2,
     1130.0, (0.68, 0.05, 0.09, 0.11, 0.05, 0.02), 0.0002),
    # the fastest of all, but its step-1 loss is off plain PyTorch's: measured, never a best
    (13, "probe", "diverged", "fsdp", {"cpu_offload": True, "reshard_after_forward": False}, 8, 2,
     5000.0, (0.70, 0.10, 0.10, 0.05, 0.03, 0.02), 0.21),
]


def backend_trials(start: datetime | None = None) -> list[dict]:
    """realistic_trials (SpeedLoader's, from before there were backends: no backend named) and DeepSpeed's and
    FSDP's, as GET /jobs/{id}/trials gives them. A DeepSpeed trial names its backend in its result's config only,
    an FSDP one in its stored config too: the dashboards read either."""
    t0 = start or datetime(2026, 1, 1, 12, 0, 0, tzinfo=timezone.utc)
    out = realistic_trials(t0)
    for num, role, status, backend, knobs, b, n, tps, bd, rel in BACKEND_ROWS:
        ran = {"sub_batch_size": b, "num_sub_batches": n, "num_live_blocks": None, "schedule": None, "seq_len": 64,
               "world_size": 1, "backend": backend, **knobs}
        result = {"status": status, "config": ran, "tokens_per_s": tps,
                  "step_seconds": b * n * 64 / tps if tps else None,
                  "peak_device_bytes": 3_000_000 + 100_000 * num, "peak_host_bytes": 400_000_000, "breakdown": None,
                  "error": {"ok": None, "oom": "device memory limit exceeded on cpu",
                            "diverged": f"step-1 loss off plain PyTorch's by {rel}"}[status]}
        if bd is not None:
            result["breakdown"] = dict(zip(("compute", "memcpy", "cpu", "all_gather", "reduce_scatter", "other"), bd))
        if rel is not None:
            result["parity"] = {"loss": 10.4 * (1 + rel), "reference_loss": 10.4, "rel_diff": rel, "tolerance": 0.01,
                                "ok": rel <= 0.01}
        config = {"sub_batch_size": b, "num_sub_batches": n,
                  **({"backend": backend, **knobs} if backend == "fsdp" else {})}
        at = t0 + timedelta(seconds=10 * num)
        out.append({"number": num, "role": role, "status": status, "config": config, "predicted": {}, "result": result,
                    "started_at": at, "finished_at": at + timedelta(seconds=7),
                    "trace_url": f"/jobs/j/trials/{num}/trace" if status == "ok" else None})
    return out


def measured_job() -> dict:
    """A real job over the three backends on a 2-core CPU machine (llama-tiny, seq_len 32, a 5 MiB device limit,
    b in 1, 2, 16, one confirmation round, profiled), as the store held it: its spec, its result (best and
    best_by_backend pool each pick's trials) and its trials with their whole TrialResults (timing, breakdown and its
    seconds, top operators, parity, DeepSpeed's backend_detail) and predictions. DeepSpeed's pick, trial #2, ran
    6,953 tokens/s on its own and its confirmation 3,664: the pick's figure is 5,219, their steps' median. SpeedLoader's
    and FSDP's b=16 trials (#8, #5) ran out of device memory."""
    data = json.loads(MEASURED_JOB.read_text())
    for t in data["trials"]:
        t["started_at"], t["finished_at"] = (datetime.fromisoformat(t[k]) for k in ("started_at", "finished_at"))
    return data


MIB = 1024 * 1024
DEVICE_LIMIT, HOST_LIMIT = 6 * MIB, 8 * 1024 * MIB
