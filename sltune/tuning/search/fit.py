"""Linear resource and throughput models fitted by least squares on measured trials.

Peak memory is close to linear in the knobs (../shared/design/speedloader.md):

    train    peak_device ~ c0 + c1*k + c1'*k*[G>1] + c2*b*s + c3*k*b*s + c4*B*s + c5*[off]*k*b*s
                          (the live group's parameters and gradients; the next group, prefetched while
                          this one computes, when there is one (G>1: k more layers; otherwise only the
                          small embedding or head, in c0); a group's activations; and the whole batch's
                          token ids, labels and per-sub-batch layer arguments, on the device all step;
                          under activations: offload, one group's saved tensors loaded back, for this
                          sub-batch and the next)
             peak_host   ~ d0 + d1*(G+1)*B*s + d2*[off]*(L-k)*B*s (parameters and AdamW state in d0,
                                                                   boundary activations of every sub-batch,
                                                                   offload: saved tensors of every layer below
                                                                   the turnaround group, every sub-batch)
             step_time   ~ t0 + t1*G + t2*N + t3*N*b*s + t4*N*G    (per step, group, sub-batch, token, and
                          + t5*[off]*(L-k)*N*b*s                  sub-batch-in-group costs; offload's copies of
                                                                   saved tensors in place of recompute's forward
                                                                   of the same layers: t5 is their difference)
    generate the same with s = prompt+new tokens per row, plus D*B*s on the device (D = 1 when kv_cache is
             device: every sub-batch's KV cache) and W (the share of the parameter bytes weights_on_device
             keeps there for the whole call, in whole units as the engine keeps them: its coefficient is
             about the parameter bytes); host ~ e0 + e1*B*s (every sub-batch's KV cache). In the
             step time, N counts the weight reads: every sub-batch reads all the weights once per step,
             which at a fixed B = b*N favours fewer, larger sub-batches where reading weights bounds a
             decode step's small matmuls; t3*N*b*s is the per-token work, which B fixes. W/N there is the
             parameter traffic kept weights save, copied in once per call instead of at every decode step,
             as far as it shows: the copy of a unit is hidden behind the N sub-batches that run on it
             (CUDA streams), or warms the cache they read it from (the CPU), so its visible cost falls as
             N grows. Measured on llama-small, 16 rows, 2 CPU threads (bench/generate.py, 3 rounds):
             keeping every weight ran 1.39x faster at b=16 N=1 and 0.86x at b=1 N=16; a plain W term
             fitted to probes at large N predicted step times <= 0 at N=1.

Across depths (search.probe_layers: oneshot's probes run fewer layers, sltune.tuning.search.probes) a training job's
models are ACROSS_DEPTHS: each term carries its known depth scaling, so that probes of one depth fix every
coefficient. The step's per-step cost grows with the parameter bytes P (loads, gradient offload, optimizer), a
token's work with the weights it reads F (the layers and the head), the group terms with G and the offload
terms with L-k. The peaks start from the prior at the trial's own depth (LinearFit.offset), whose terms carry
L exactly; the device's fitted residual does not depend on L, and the host's is a constant.

G = ceil(layers/k) groups, B = b*N rows. Throughput is tokens per step over step_time, so it rises with
b and N and saturates. Each model reports its coefficients, R^2, residuals, leave-one-out error (how
far to trust a prediction) and the range of every variable it saw (so extrapolation can be flagged).
Fits minimise relative error (each row weighted by 1/measured): a 2 ms step and a 2 s step, or a 1 MiB
and a 1 GiB peak, count alike. L is the number of layers and [off] is 1 under activations: offload; the
[off] terms drop out of a fit whose space does not sweep activations, as any feature constant over it does.
[disk] is 1 under optimizer_offload: disk, whose reads and writes add a per-step time; the peaks need no term for
it: the prior (their offset) moves the master and optimizer state from host memory into files term by term.
[wdisk] is 1 under param_offload: disk: every step reads each unit's weights file at its loads (training: twice,
and writes its new version; generation: once a decoding step), a per-step time; and the host peak gets a constant
for it beside the prior's window (sltune.tuning.cost.prior: the units read ahead, spare and staged buffers, two
units' gradient sums), a formula of what the window holds at most, which the trials correct as they measure it.

The wrapped backends (search.backend deepspeed, fsdp) run a micro-batch of b rows N times a step (gradient
accumulation), every layer each time, so the same linear terms hold for their knobs, and each backend's models are
fitted to its own trials (BACKEND_MODELS; the fits' keys are fit_key's: "device" for SpeedLoader as ever,
"deepspeed.device" for DeepSpeed's):

    peak_device, peak_host ~ prior + c0 + c1*b*s + c2*[off]*b*s + a constant per knob value away from the first
                             (one micro-batch's activations; the knobs' model states are the prior's,
                             sltune.tuning.cost.wrapped, and the constants correct each one's error)
    step_time              ~ t0 + t1*N + t2*N*b*s + t3*[off]*N*b*s + the knobs' costs: per micro-batch where they
                             move weights each forward and backward (ZeRO-3's gathers, offload_param's and
                             cpu_offload's copies, keeping every gathered layer), per step where they move the
                             optimizer (offload_optimizer, cpu_offload, nvme's files)

A knob whose value the space does not sweep drops out of the fit, as any feature constant over it does.

Step times are noisy where peaks are not, so the throughput model is fitted differently: each point is
weighted by its measured precision (the width of its bootstrap interval, so its residual is counted in
its own standard errors) and the loss is robust, with scipy.optimize.least_squares: first soft-L1 (convex,
so it starts from anywhere), then Cauchy from there. Soft-L1 alone is not enough: its pull never stops
growing, so with the ten or so points a search has, one trial slowed 2.5x by another process at a corner
of the space still moved predictions by several times their noise; Cauchy's influence falls back towards
zero for such a point. (statsmodels' RLM does the same but takes no per-point precision and would add a
dependency; scipy is already in the stack.) Peaks are measured exactly, so their fits stay ordinary
least squares, where every point counts fully.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
from scipy.optimize import least_squares

from sltune.tuning.cost.shape import ModelShape
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
    "[off]*k*b*s": lambda v: v["off"] * v["k"] * v["b"] * v["s"],
    "[off]*(L-k)*B*s": lambda v: v["off"] * max(v["L"] - v["k"], 0) * v["B"] * v["s"],
    "[off]*(L-k)*N*b*s": lambda v: v["off"] * max(v["L"] - v["k"], 0) * v["N"] * v["b"] * v["s"],
    "D*B*s": lambda v: v["D"] * v["B"] * v["s"],
    # optimizer_offload disk: each step reads and writes every block's master and state once, and waits for what
    # the backward did not hide; per step, whatever b and N (across depths it grows with the parameter bytes)
    "[disk]": lambda v: v.get("disk", 0.0),
    "[disk]*P": lambda v: v.get("disk", 0.0) * v["P"],
    # param_offload disk: each step reads the weights' files (and in training writes their new version): per step
    "[wdisk]": lambda v: v.get("wdisk", 0.0),
    "[wdisk]*P": lambda v: v.get("wdisk", 0.0) * v["P"],
    "W": lambda v: v["W"],
    "W/N": lambda v: v["W"] / v["N"],
    # across depths (search.probe_layers; sltune.tuning.search.probes): P the parameter bytes, F those a token's compute
    # reads (the layers and the head)
    "P": lambda v: v["P"],
    "F*N*b*s": lambda v: v["F"] * v["N"] * v["b"] * v["s"],
    # the prior (sltune.tuning.cost.prior): each peak predicted from the shape before any trial; the memory models fit
    # what the trials measure beyond it (LinearFit.offset), so with no trial the prior alone predicts
    "prior_device": lambda v: v["prior_device"],
    "prior_host": lambda v: v["prior_host"],
    # the wrapped backends (BACKEND_MODELS): their knobs as 0/1 (wrapped_variables); absent for SpeedLoader's configs
    "[off]*b*s": lambda v: v["off"] * v["b"] * v["s"],
    "[off]*N*b*s": lambda v: v["off"] * v["N"] * v["b"] * v["s"],
    **{f"[{knob}]": (lambda v, knob=knob: v.get(knob, 0.0)) for knob in
       ("zero3", "offload_optimizer", "offload_param", "nvme", "cpu_offload", "keep_gathered")},
    **{f"[{knob}]*N": (lambda v, knob=knob: v.get(knob, 0.0) * v["N"]) for knob in
       ("zero3", "offload_param", "cpu_offload", "keep_gathered")},
}

MODELS = {
    "train": {
        "device": ("peak_device_bytes", ["1", "k", "k*[G>1]", "b*s", "k*b*s", "B*s", "[off]*k*b*s"]),
        "host": ("peak_host_bytes", ["1", "(G+1)*B*s", "[off]*(L-k)*B*s", "[wdisk]"]),
        "throughput": ("step_seconds", ["1", "G", "N", "N*b*s", "N*G", "[off]*(L-k)*N*b*s", "[disk]", "[wdisk]"]),
    },
    "generate": {   # s = prompt + new tokens; the host holds every sub-batch's KV cache (B*s), the device
                    # one group's cache for one sub-batch (k*b*s)
        "device": ("peak_device_bytes", ["1", "k", "k*[G>1]", "b*s", "k*b*s", "B*s", "D*B*s", "W"]),
        "host": ("peak_host_bytes", ["1", "B*s", "[wdisk]"]),
        "throughput": ("step_seconds", ["1", "G", "N", "N*b*s", "N*G", "W/N", "[wdisk]"]),
    },
}


# search.probe_layers (training): the step time's terms each with its depth scaling (sltune.tuning.search.probes): the
# per-step costs grow with P, a token's work with F; over trials of one depth P and F are constants and this is the
# model above. The peaks start from the prior at each trial's own depth, which counts the weights, master,
# gradients, optimizer state and group-edge activations term by term; the device's residual terms do not depend
# on L, and the host's is a constant: probes of one depth cannot tell a per-group residual from a per-sub-batch one,
# and a wrong split grows by L/Lp at full depth (fitting (G+1)*B*s to 4-layer probes put 16-layer host peaks 47%
# too high; the prior and a constant: 3-6% low, the same as at the probes' own b and N).
ACROSS_DEPTHS = {
    "device": MODELS["train"]["device"],
    "host": ("peak_host_bytes", ["1", "[wdisk]"]),
    "throughput": ("step_seconds", ["P", "G", "N", "F*N*b*s", "N*G", "[off]*(L-k)*N*b*s", "[disk]*P", "[wdisk]*P"]),
}
# the memory models fit what trials measure beyond the prior (its peaks, sltune.tuning.cost.prior), at one depth or
# across depths alike
PRIOR_OFFSETS = {"device": "prior_device", "host": "prior_host"}

_DS_MEMORY = ["1", "b*s", "[off]*b*s", "[zero3]", "[offload_optimizer]", "[offload_param]"]
_FSDP_MEMORY = ["1", "b*s", "[off]*b*s", "[cpu_offload]", "[keep_gathered]"]
# each wrapped backend's models, fitted to its own trials (the module docstring)
BACKEND_MODELS = {
    "deepspeed": {
        "device": ("peak_device_bytes", _DS_MEMORY),
        "host": ("peak_host_bytes", _DS_MEMORY),
        "throughput": ("step_seconds", ["1", "N", "N*b*s", "[off]*N*b*s", "[zero3]*N", "[offload_optimizer]",
                                        "[offload_param]*N", "[nvme]"]),
    },
    "fsdp": {
        "device": ("peak_device_bytes", _FSDP_MEMORY),
        "host": ("peak_host_bytes", _FSDP_MEMORY),
        "throughput": ("step_seconds", ["1", "N", "N*b*s", "[off]*N*b*s", "[cpu_offload]", "[cpu_offload]*N",
                                        "[keep_gathered]*N"]),
    },
}


def fit_key(backend: str, kind: str) -> str:
    """A fit's name in a job's models: the kind for SpeedLoader (as before there were backends), else
    "backend.kind"."""
    return kind if backend == "speedloader" else f"{backend}.{kind}"


def split_key(key: str) -> tuple[str, str]:
    """(backend, kind) of a fit_key."""
    backend, _, kind = key.rpartition(".")
    return backend or "speedloader", kind


def variables(c: Candidate, shape: ModelShape, tokens_per_row: int) -> dict[str, float]:
    """The quantities the features are made of, for one candidate (a wrapped backend's: no live blocks or groups,
    k = G = 0, and its knobs as 0/1)."""
    batch = {"b": c.sub_batch_size, "N": c.num_sub_batches, "B": c.batch, "s": tokens_per_row, "L": shape.layers,
             "off": 1.0 if c.activations == "offload" else 0.0}
    if c.backend != "speedloader":
        return {**batch, "k": 0.0, "G": 0.0, "D": 0.0, "disk": 0.0, "wdisk": 0.0, "W": 0.0, **wrapped_variables(c)}
    return {**batch, "k": c.num_live_blocks, "G": shape.groups(c.num_live_blocks), "D": float(c.kv_on_device),
            "disk": float(c.on_disk), "wdisk": float(c.weights_on_disk),
            "W": kept_fraction(shape, c)}


def wrapped_variables(c: Candidate) -> dict[str, float]:
    """A wrapped backend's knobs as 0/1: each value away from the one that moves the least (ZeRO-3, offloading,
    nvme's files, FSDP's cpu_offload, keeping every gathered layer)."""
    offloaded = {"offload_optimizer": c.offload_optimizer, "offload_param": c.offload_param}
    if c.backend == "deepspeed":
        return {"zero3": float(c.zero_stage == 3), **{k: float(v not in (None, "none")) for k, v in offloaded.items()},
                "nvme": float("nvme" in offloaded.values())}
    return {"cpu_offload": float(bool(c.cpu_offload)), "keep_gathered": float(c.reshard_after_forward is False)}


def kept_fraction(shape: ModelShape, c: Candidate) -> float:
    """W: the share of the parameter bytes c keeps on the device, in the whole units the engine keeps (so
    at most c.weights_on_device); 0 in training, where nothing is kept."""
    if not c.weights_on_device:
        return 0.0
    total = sum(shape.unit_bytes(c.num_live_blocks))
    return shape.kept_bytes(c.num_live_blocks, c.weights_on_device) / total if total else 0.0


@dataclass
class LinearFit:
    target: str
    features: list[str]
    coef: list[float] = field(default_factory=list)
    n: int = 0
    rank: int = 0
    r2: float | None = None
    loo_rel_error: float | None = None          # max relative leave-one-out error; None if too few points
    loo_typical_error: float | None = None      # the median one: what to expect of a prediction
    robust: bool = False                        # precision-weighted robust fit (see the module docstring)
    residuals: list[dict[str, Any]] = field(default_factory=list)
    ranges: dict[str, list[float]] = field(default_factory=dict)
    offset: str | None = None                   # a known term (a FEATURES name) with coefficient 1, not fitted

    @property
    def well_posed(self) -> bool:
        return self.n >= len(self.features) and self.rank == len(self.features)

    @classmethod
    def fit(cls, target: str, features: list[str], rows: list[tuple[dict[str, float], float]],
            rel_sigma: list[float] | None = None, offset: str | None = None) -> "LinearFit":
        """rel_sigma: each row's relative standard error; given, the fit is precision-weighted and robust.
        offset: a term known exactly (the host bytes of the parameters at the trial's depth, say), added to
        the fitted ones rather than fitted; over rows of one depth it is a constant the intercept absorbs."""
        model = cls(target=target, features=features, n=len(rows), robust=rel_sigma is not None, offset=offset)
        if not rows:
            return model
        X = np.array([[FEATURES[f](v) for f in features] for v, _ in rows], dtype=float)
        y = np.array([y for _, y in rows], dtype=float)
        known = np.array([FEATURES[offset](v) if offset else 0.0 for v, _ in rows], dtype=float)
        scale = np.maximum(np.abs(X).max(axis=0), 1e-300)     # condition the columns
        w = 1.0 / np.maximum(np.abs(y), 1e-300)                 # relative error
        if rel_sigma is not None:
            w = w / np.maximum(np.asarray(rel_sigma, dtype=float), MIN_REL_SIGMA)
        solve = _robust if model.robust else _ols
        coef = solve(X / scale, y - known, w)
        model.rank = int(np.linalg.matrix_rank(X / scale))
        model.coef = (coef / scale).tolist()
        pred = X @ np.array(model.coef) + known
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
                c = solve(X[keep] / scale, (y - known)[keep], w[keep])
                p = float((X[i] / scale) @ c + known[i])
                if y[i]:
                    errs.append(float(abs(p - y[i]) / abs(y[i])))
            model.loo_rel_error = max(errs) if errs else None
            model.loo_typical_error = float(np.median(errs)) if errs else None
        return model

    def predict(self, v: dict[str, float]) -> float | None:
        if not self.well_posed:
            return None
        known = FEATURES[self.offset](v) if self.offset else 0.0
        return float(known + sum(c * FEATURES[f](v) for c, f in zip(self.coef, self.features)))

    def extrapolated(self, v: dict[str, float]) -> list[str]:
        """Variables of v outside the range the fit saw (a prediction there is an extrapolation)."""
        return [k for k, (lo, hi) in self.ranges.items() if k in v and not lo <= v[k] <= hi]

    def to_dict(self) -> dict[str, Any]:
        out = {"target": self.target, "features": self.features, "coef": self.coef, "n": self.n, "rank": self.rank,
               "r2": self.r2, "loo_rel_error": self.loo_rel_error, "loo_typical_error": self.loo_typical_error,
               "robust": self.robust, "residuals": self.residuals, "ranges": self.ranges,
               **({"offset": self.offset} if self.offset else {})}
        why = no_loo_reason(out)
        return {**out, **({"loo_missing": why} if why else {})}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "LinearFit":
        return cls(**{k: d[k] for k in ("target", "features", "coef", "n", "rank", "r2", "loo_rel_error",
                                        "loo_typical_error", "robust", "residuals", "ranges", "offset") if k in d})


def no_loo_reason(model: dict[str, Any]) -> str | None:
    """Why a fit (as to_dict gives it, or a best.yaml from before this was said) has no leave-one-out error, in
    words a reader can act on: more trials, or trials that differ in more knobs. None when it has one."""
    if model.get("loo_rel_error") is not None:
        return None
    n, coefficients = int(model.get("n") or 0), len(model.get("features") or [])
    if n <= coefficients:
        short = coefficients - n
        predicts = (f"it predicts after {short} more trial{'s' * (short != 1)} that differ in its knobs, and "
                    if short > 0 else "")
        return (f"too few points for a leave-one-out fit: {n} point{'s' * (n != 1)} for {coefficients} "
                f"coefficient{'s' * (coefficients != 1)}: {predicts}has a leave-one-out error after {short + 1} more "
                f"({coefficients + 1} in all)")
    return (f"every leave-one-out fit is underdetermined: without any one of its {n} points, the other {n - 1} do "
            f"not fix its {coefficients} coefficients (the trials differ in too few knobs)")


MIN_REL_SIGMA = 0.005   # no measurement is trusted beyond 0.5%: a hundred quiet steps are not the truth either
ROBUST_SCALE = 2.0      # residuals (in standard errors) beyond which a point's pull stops growing as its square


def _ols(A: np.ndarray, y: np.ndarray, w: np.ndarray) -> np.ndarray:
    coef, *_ = np.linalg.lstsq(A * w[:, None], y * w, rcond=None)
    return coef


def _robust(A: np.ndarray, y: np.ndarray, w: np.ndarray) -> np.ndarray:
    def residuals(c: np.ndarray) -> np.ndarray:
        return (A @ c - y) * w

    coef = _ols(A, y, w)
    for loss in ("soft_l1", "cauchy"):
        coef = least_squares(residuals, coef, loss=loss, f_scale=ROBUST_SCALE).x
    return coef
