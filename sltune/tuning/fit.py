"""Linear resource and throughput models fitted by least squares on measured trials.

Peak memory is close to linear in the knobs (../shared/design/speedloader.md):

    train    peak_device ~ c0 + c1*k + c1'*k*[G>1] + c2*b*s + c3*k*b*s + c4*B*s
                          (the live group's parameters and gradients; the next group, prefetched while
                          this one computes, when there is one (G>1: k more layers; otherwise only the
                          small embedding or head, in c0); a group's activations; and the whole batch's
                          token ids, labels and per-sub-batch layer arguments, on the device all step)
             peak_host   ~ d0 + d1*(G+1)*B*s                      (parameters and AdamW state in d0,
                                                                   boundary activations of every sub-batch)
             step_time   ~ t0 + t1*G + t2*N + t3*N*b*s + t4*N*G    (per step, group, sub-batch, token, and
                                                                   sub-batch-in-group costs)
    generate the same with s = prompt+new tokens per row, plus D*B*s on the device (D = 1 when kv_cache is
             device: every sub-batch's KV cache); host ~ e0 + e1*B*s (every sub-batch's KV cache). In the
             step time, N counts the weight reads: every sub-batch reads all the weights once per step,
             which at a fixed B = b*N favours fewer, larger sub-batches where reading weights bounds a
             decode step's small matmuls; t3*N*b*s is the per-token work, which B fixes.

G = ceil(layers/k) groups, B = b*N rows. Throughput is tokens per step over step_time, so it rises with
b and N and saturates. Each model reports its coefficients, R^2, residuals, leave-one-out error (how
far to trust a prediction) and the range of every variable it saw (so extrapolation can be flagged).
Fits minimise relative error (each row weighted by 1/measured): a 2 ms step and a 2 s step, or a 1 MiB
and a 1 GiB peak, count alike.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from sltune.tuning.shape import ModelShape
from sltune.tuning.space import Candidate

FEATURES: dict[str, Callable[[dict[str, float]], float]] = {
    "1": lambda v: 1.0,
    "k": lambda v: v["k"],
    "k*[G>1]": lambda v: v["k"] if v["G"] > 1 else 0.0,
    "G": lambda v: v["G"],
    "N": lambda v: v["N"],
    "b*s": lambda v: v["b"] * v["s"],
    "k*b*s": lambda v: v["k"] * v["b"] * v["s"],
    "B*s": lambda v: v["B"] * v["s"],
    "(G+1)*B*s": lambda v: (v["G"] + 1) * v["B"] * v["s"],
    "N*b*s": lambda v: v["N"] * v["b"] * v["s"],
    "N*G": lambda v: v["N"] * v["G"],
    "D*B*s": lambda v: v["D"] * v["B"] * v["s"],
}

MODELS = {
    "train": {
        "device": ("peak_device_bytes", ["1", "k", "k*[G>1]", "b*s", "k*b*s", "B*s"]),
        "host": ("peak_host_bytes", ["1", "(G+1)*B*s"]),
        "throughput": ("step_seconds", ["1", "G", "N", "N*b*s", "N*G"]),
    },
    "generate": {   # s = prompt + new tokens; the host holds every sub-batch's KV cache (B*s), the device
                    # one group's cache for one sub-batch (k*b*s)
        "device": ("peak_device_bytes", ["1", "k", "k*[G>1]", "b*s", "k*b*s", "B*s", "D*B*s"]),
        "host": ("peak_host_bytes", ["1", "B*s"]),
        "throughput": ("step_seconds", ["1", "G", "N", "N*b*s", "N*G"]),
    },
}


def variables(c: Candidate, shape: ModelShape, tokens_per_row: int) -> dict[str, float]:
    """The quantities the features are made of, for one candidate."""
    return {"b": c.b, "N": c.n, "k": c.k, "B": c.batch, "s": tokens_per_row, "G": shape.groups(c.k),
            "D": float(c.kv_on_device)}


@dataclass
class LinearFit:
    target: str
    features: list[str]
    coef: list[float] = field(default_factory=list)
    n: int = 0
    rank: int = 0
    r2: float | None = None
    loo_rel_error: float | None = None          # max relative leave-one-out error; None if too few points
    residuals: list[dict[str, Any]] = field(default_factory=list)
    ranges: dict[str, list[float]] = field(default_factory=dict)

    @property
    def well_posed(self) -> bool:
        return self.n >= len(self.features) and self.rank == len(self.features)

    @classmethod
    def fit(cls, target: str, features: list[str], rows: list[tuple[dict[str, float], float]]) -> "LinearFit":
        model = cls(target=target, features=features, n=len(rows))
        if not rows:
            return model
        X = np.array([[FEATURES[f](v) for f in features] for v, _ in rows], dtype=float)
        y = np.array([y for _, y in rows], dtype=float)
        scale = np.maximum(np.abs(X).max(axis=0), 1e-300)     # condition the columns
        w = 1.0 / np.maximum(np.abs(y), 1e-300)                 # relative error
        coef, *_ = np.linalg.lstsq(X / scale * w[:, None], y * w, rcond=None)
        model.rank = int(np.linalg.matrix_rank(X / scale))
        model.coef = (coef / scale).tolist()
        pred = X @ np.array(model.coef)
        ss_tot = float(((y - y.mean()) ** 2).sum())
        model.r2 = 1.0 - float(((y - pred) ** 2).sum()) / ss_tot if ss_tot > 0 else None
        model.residuals = [{"vars": v, "measured": float(m), "predicted": float(p),
                            "rel_error": float((p - m) / m) if m else None} for (v, m), p in zip(rows, pred)]
        for name in rows[0][0]:
            vals = [v[name] for v, _ in rows]
            model.ranges[name] = [min(vals), max(vals)]
        if model.n > len(features):
            errs = []
            for i in range(model.n):
                keep = np.arange(model.n) != i
                if np.linalg.matrix_rank(X[keep] / scale) < len(features):
                    continue
                c, *_ = np.linalg.lstsq(X[keep] / scale * w[keep, None], y[keep] * w[keep], rcond=None)
                p = float((X[i] / scale) @ c)
                if y[i]:
                    errs.append(float(abs(p - y[i]) / abs(y[i])))
            model.loo_rel_error = max(errs) if errs else None
        return model

    def predict(self, v: dict[str, float]) -> float | None:
        if not self.well_posed:
            return None
        return float(sum(c * FEATURES[f](v) for c, f in zip(self.coef, self.features)))

    def extrapolated(self, v: dict[str, float]) -> list[str]:
        """Variables of v outside the range the fit saw (a prediction there is an extrapolation)."""
        return [k for k, (lo, hi) in self.ranges.items() if k in v and not lo <= v[k] <= hi]

    def to_dict(self) -> dict[str, Any]:
        return {"target": self.target, "features": self.features, "coef": self.coef, "n": self.n, "rank": self.rank,
                "r2": self.r2, "loo_rel_error": self.loo_rel_error, "residuals": self.residuals,
                "ranges": self.ranges}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "LinearFit":
        return cls(**{k: d[k] for k in ("target", "features", "coef", "n", "rank", "r2", "loo_rel_error",
                                        "residuals", "ranges") if k in d})
