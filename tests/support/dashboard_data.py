"""Trials and fitted models as a real job of examples/tiny-llama-cpu.yaml measured them: the figures, the pages
and the browser test draw the same data."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

from sltune.tuning.search.fit import MODELS, LinearFit, variables
from sltune.tuning.cost.shape import shape_of
from sltune.tuning.space import Candidate

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
    """The job's fitted models, fitted by sltune's own least squares on the ok trials."""
    out = {}
    for kind, (target, feats) in MODELS["train"].items():
        rows = []
        for t in trials:
            r = t["result"]
            if t["status"] != "ok" or r.get(target) is None:
                continue
            rows.append((variables(Candidate.from_knobs(t["config"]), shape_of("llama-tiny"), 64), float(r[target])))
        out[kind] = LinearFit.fit(target, feats, rows).to_dict()
    return out
