"""What a search knows after some trials: the history, the fitted models, and predictions from them."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from sltune.tuning.cost.correction import Correction
from sltune.tuning.cost.depth import DepthTerms, least_probe_layers
from sltune.tuning.cost.prior import Prior, at_depth, predict as prior_of
from sltune.tuning.cost.setup import Setup
from sltune.tuning.cost.shape import ModelShape
from sltune.tuning.cost.step_time import MissingRate, StepTime, step_time
from sltune.tuning.search.fit import (ACROSS_DEPTHS, BACKEND_MODELS, FEATURES, MODELS, PRIOR_OFFSETS, LinearFit,
                                      fit_key, split_key, variables)
from sltune.tuning.space import Candidate, SearchSpace
from sltune.tuning.spec import TuningSpec

if TYPE_CHECKING:
    from sltune.machine.rates import MachineRates

log = logging.getLogger("sltune.tuning")

# A full-depth step at least this long makes auto probe at reduced depth: a whole-model probe's steps (a warm-up
# that measures memory, at least two timed, the profiled one) then take several seconds, where its start-up
# (setup_s, forking and building the model) took under a second here for a 59M-parameter model.
AUTO_STEP_S = 0.5
# The error allowed the step-time prior corrected by fewer than 3 trials (so with no error of its own): one factor
# fitted to a backend's first trial left llama-small's other configs 16-17% off (median), the full correction from 18
# trials 7% with a 90th percentile of 14% (bench/prior_time.py, docs/benchmarks.md). MIN_PRIOR_ERROR: no less than a
# trial's own noise on a shared machine.
PRIOR_ERROR = 0.20
MIN_PRIOR_ERROR = 0.03
# what makes a step cheaper, when every config's trial would outlast search.trial_timeout_s (the search's stop, plan)
CHEAPER_STEP = ("a shorter workload.seq_len, fewer layers, float32 where this CPU's bfloat16 or float16 matmuls are "
                "slow: `sltune calibrate SPEC` shows its rates")


def layers_of(done: "FinishedTrial") -> int | None:
    """The decoder layers a trial ran, as it reported them (None: not reported, the whole model)."""
    return ((done.result or {}).get("config") or {}).get("num_layers")


@dataclass
class FinishedTrial:
    """A trial that finished (ok, oom, failed, timeout or diverged) with its TrialResult as a dict. Only an ok one
    counts as measured: a diverged trial ran, but its step-1 loss is not plain PyTorch's, so its figures are of a run
    that does not train the model; it is never fitted, picked, confirmed or exported."""

    number: int
    candidate: Candidate
    role: str
    result: dict[str, Any]

    @property
    def ok(self) -> bool:
        return self.result["status"] == "ok"

    @property
    def tokens_per_s(self) -> float:
        return self.result.get("tokens_per_s") or 0.0


def rel_sigma(result: dict[str, Any], believe_unstable: bool = False) -> float:
    """A trial's relative standard error, from its 95% bootstrap interval (half-width / 1.96 / median). A
    result without one (older trials, a single step) counts as 5%; one still unstable after its re-measure
    (another process took cores from it) as at least UNSTABLE_SIGMA: its steps may agree with each other
    yet all be slow, so a narrow interval must not make it count more."""
    timing = result.get("timing") or {}
    ci, tps = timing.get("tokens_per_s_ci95"), result.get("tokens_per_s")
    sigma = (ci[1] - ci[0]) / 2 / 1.96 / tps if ci and tps and ci[1] > ci[0] else 0.05
    return max(sigma, UNSTABLE_SIGMA) if timing.get("unstable") and not believe_unstable else sigma


UNSTABLE_SIGMA = 0.10


@dataclass
class Prediction:
    device: float | None
    host: float | None
    step_seconds: float | None
    tokens_per_s: float | None
    fits: bool
    over: list[str] = field(default_factory=list)       # which limits it is predicted to exceed
    prior_device: float | None = None                   # the prior alone (sltune.tuning.cost.prior), before any trial
    prior_host: float | None = None
    disk: float | None = None                           # optimizer_offload or param_offload disk: its files at their
                                                        # fullest (from the shape: the prior's)
    prior_step: StepTime | None = None                  # the step-time prior from the machine's rates, corrected by
                                                        # the backend's trials so far (None: no rates stored)

    def to_dict(self) -> dict[str, Any]:
        return {"peak_device_bytes": self.device, "peak_host_bytes": self.host, "step_seconds": self.step_seconds,
                "tokens_per_s": self.tokens_per_s, "fits": self.fits, "over": self.over,
                "prior_device_bytes": self.prior_device, "prior_host_bytes": self.prior_host,
                **({"peak_disk_bytes": self.disk} if self.disk else {}),
                **({"prior_step_seconds": self.prior_step.seconds,
                    "prior_tokens_per_s": self.prior_step.tokens_per_s,
                    "prior_breakdown": self.prior_step.to_dict()["predicted_breakdown"]} if self.prior_step else {})}


class SearchState:
    """History plus models; refit() after every trial."""

    def __init__(self, spec: TuningSpec, shape: ModelShape, space: SearchSpace, baseline: int = 0,
                 host_ceiling: int | None = None, disk_ceiling: int | None = None,
                 rates: "MachineRates | None" = None):
        """`baseline`: what a trial process holds before its model (sltune.tuning.cost.baseline; 0 leaves it out of the
        host prior); `host_ceiling`: the host limit trials get when the spec names none (the machine's or the
        server's), which predictions are held to as to the spec's own; `disk_ceiling`: the free space where
        trials offload to, which disk configs are held to beside the spec's hardware.disk_limit; `rates`: this
        machine's (sltune calibrate), from which each config's step is predicted before any trial (the step-time
        prior, corrected by each backend's trials as they finish)."""
        self.spec = spec
        self.shape = shape
        self.space = space
        self.tokens_per_row = spec.workload.tokens_per_row
        self.history: list[FinishedTrial] = []
        self.confirms: list[FinishedTrial] = []          # the confirmation round's trials: not search history
        self.fits: dict[str, LinearFit] = {}             # by fit_key: "device" (SpeedLoader's), "fsdp.device", ...
        self.margins = {"device": spec.search.margin, "host": spec.search.margin, "disk": spec.search.margin}
        # search.probe_layers: the fits take the depth as a variable (sltune.tuning.search.probes)
        self.depth = DepthTerms.of(shape) if spec.search.probe_layers is not None else None
        # each backend's models, fitted to its own trials: a SpeedLoader-only job's are named as before backends
        own = {"speedloader": ACROSS_DEPTHS if self.depth else MODELS[spec.workload.mode], **BACKEND_MODELS}
        self.models = {fit_key(b, kind): model for b in space.backends for kind, model in own[b].items()}
        self.recipe = Setup.of_spec(spec, shape, baseline)
        self.host_ceiling = host_ceiling
        self.disk_ceiling = disk_ceiling
        self._priors: dict[tuple[Candidate, int | None], Prior] = {}
        self.rates = rates
        self.corrections: dict[str, Correction | None] = {}     # per backend, from its trials (refit)
        self._steps: dict[tuple[Candidate, int | None], StepTime | None] = {}
        self._guided: bool | None = None
        # the seconds left of the job's time budget (the runner's clock; None: no clock, as in plan)
        self.seconds_left: Callable[[], float] | None = None
        depths = [None]
        if self.depth:
            wanted = spec.search.probe_layers
            depths.append(least_probe_layers(space.k_values) if wanted == "auto" else int(wanted))
        # features that vary over this space at all (a fixed effective batch makes N*b*s a constant, say)
        self.features = {key: self._varying(feats, depths, split_key(key)[0])
                         for key, (_, feats) in self.models.items()}

    def vars(self, c: Candidate, layers: int | None = None, prior: bool = True) -> dict[str, float]:
        """The fits' variables for c, at `layers` decoder layers (None: the whole model); with `prior`, its
        predicted peaks before any trial too."""
        shape = self.shape if layers is None else dataclasses.replace(self.shape, layers=layers)
        v = variables(c, shape, self.tokens_per_row)
        if self.depth:
            v.update(self.depth.vars(shape.layers))
        if prior:
            p = self.prior(c, layers)
            v.update(prior_device=float(p.device), prior_host=float(p.host), prior_disk=float(p.disk))
        return v

    def prior(self, c: Candidate, layers: int | None = None) -> Prior:
        """c's peaks predicted from the shape alone (sltune.tuning.cost.prior), at `layers` decoder layers."""
        key = (c, layers)
        if key not in self._priors:
            recipe = self.recipe if layers is None else dataclasses.replace(
                self.recipe, shape=at_depth(self.shape, layers))
            self._priors[key] = prior_of(recipe, c)
        return self._priors[key]

    def _varying(self, features: list[str], depths: list[int | None], backend: str) -> list[str]:
        rows = [[FEATURES[f](self.vars(c, d, prior=False)) for f in features]
                for c in self.space.of_backend(backend) for d in depths]
        kept: list[int] = []
        for j in range(len(features)):
            trial = np.array(rows)[:, kept + [j]]
            if np.linalg.matrix_rank(trial / np.maximum(np.abs(trial).max(axis=0), 1e-300)) == len(kept) + 1:
                kept.append(j)
        return [features[j] for j in kept]

    # -- history -------------------------------------------------------------------------------------
    def add(self, done: FinishedTrial) -> None:
        self.history.append(done)
        if done.result["status"] == "oom":
            self._widen_margin(done)
        self.refit()

    def refit(self) -> None:
        self.fits = self.fit(self.fitted())
        if self.rates is not None:      # each backend's trials correct its step-time prior
            self.corrections = {b: Correction.of([
                (self.step_prior(d.candidate, self.depth_of(d), corrected=False), float(d.result["step_seconds"]),
                 d.candidate.num_sub_batches)
                for d in self.fitted() if d.candidate.backend == b and d.result.get("step_seconds")])
                for b in self.space.backends}

    def step_prior(self, c: Candidate, layers: int | None = None, corrected: bool = True) -> StepTime | None:
        """c's step (at `layers` decoder layers; None: the whole model) predicted from the machine's rates
        (sltune.tuning.cost.step_time), corrected by its backend's trials so far; None without rates and where the
        rates lack a kind of work c does."""
        if self.rates is None:
            return None
        key = (c, layers)
        if key not in self._steps:
            recipe = self.recipe if layers is None else dataclasses.replace(
                self.recipe, shape=at_depth(self.shape, layers))
            try:
                self._steps[key] = step_time(recipe, c, self.rates, self.prior(c, layers))
            except MissingRate:
                self._steps[key] = None
            except Exception as err:  # noqa: BLE001 - an extra prediction: never what ends a search
                log.warning("no step-time prior for %s: %s: %s", c, type(err).__name__, err)
                self._steps[key] = None
        t, fix = self._steps[key], self.corrections.get(c.backend) if corrected else None
        return fix.apply(t, c.num_sub_batches) if t is not None and fix is not None else t

    def use_rates(self, rates: "MachineRates") -> None:
        """Predict each config's step from these rates from now on (a job that measured them before its first
        trial)."""
        self.rates, self._steps, self._guided = rates, {}, None
        self.refit()

    @property
    def guided(self) -> bool:
        """Whether oneshot ranks the space by the step-time prior (search.step_prior): the machine's rates are here
        and predict every config's step (they hold every kind of work the configs do)."""
        if self._guided is None:
            self._guided = self.rates is not None and self.spec.search.step_prior != "off" and all(
                self.step_prior(c, corrected=False) is not None for c in self.space.candidates)
        return self._guided

    def prior_error(self, backend: str) -> float:
        """Relative error to allow the corrected step-time prior of `backend`'s configs: the correction's own
        (each of its trials predicted from the others, typically), else PRIOR_ERROR; at least MIN_PRIOR_ERROR."""
        fix = self.corrections.get(backend)
        error = fix.error if fix is not None and fix.error is not None else PRIOR_ERROR
        return max(error, MIN_PRIOR_ERROR)

    def trial_seconds(self, c: Candidate) -> float | None:
        """The seconds a trial of c is predicted to take: the steps it runs (a warm-up that measures memory,
        search.trial_steps timed, the profiled one) and one more for its start, its parity check and its end, at its
        predicted step, allowing its backend's prior error; None without a prediction. (qwen2-0.5b's trials on 2 CPU
        cores took 4.4-6.2 of their measured steps with 2 timed, DeepSpeed's the most, and their steps 0.95-1.21x
        the uncorrected prior's: docs/benchmarks.md.) A config past search.trial_timeout_s by this would likely time
        out."""
        return self.trial_seconds_for(self.step_prior(c), c.backend)

    def trial_seconds_for(self, t: StepTime | None, backend: str) -> float | None:
        """trial_seconds of a config of `backend` whose step is predicted as t (plan's, on another machine's
        rates)."""
        if t is None:
            return None
        s = self.spec.search
        return t.seconds * (2 + s.trial_steps + s.profile) * (1 + self.prior_error(backend))

    def fitted(self) -> list[FinishedTrial]:
        """The trials the models are fitted to: every one that ran ok, at its own depth; when auto chose the
        whole model after its first probe, that one reduced-depth probe is left out."""
        ok = [d for d in self.history if d.ok]
        if self.depth and self.probe_layers() is None:
            ok = [d for d in ok if not self.reduced(d)]
        return ok

    def fit(self, done: list[FinishedTrial]) -> dict[str, LinearFit]:
        """The models fitted to these trials, each at the depth it ran; each backend's to its own trials."""
        rows = {b: [(self.vars(d.candidate, self.depth_of(d)), d.result) for d in done if d.candidate.backend == b]
                for b in self.space.backends}
        fits = {}
        for key, (target, _) in self.models.items():
            backend, kind = split_key(key)
            kept = [(v, r) for v, r in rows[backend] if r.get(target) is not None]
            data = [(v, float(r[target])) for v, r in kept]
            sigma = [rel_sigma(r) for _, r in kept] if kind == "throughput" else None
            fits[key] = LinearFit.fit(target, self.features[key], data, rel_sigma=sigma,
                                      offset=PRIOR_OFFSETS.get(kind))
        return fits

    # -- reduced-depth probes (search.probe_layers; sltune.tuning.search.probes reports on them) ---------------
    def probe_layers(self) -> int | None:
        """The depth the next probe runs at (None: the whole model), from the spec and, under auto, the first
        probe."""
        wanted = self.spec.search.probe_layers
        if wanted is None or self.depth is None:
            return None
        if wanted != "auto":
            return int(wanted)
        least = least_probe_layers(self.space.k_values)
        if 2 * least > self.shape.layers:
            return None                             # more than half the layers: too little to save
        first = next((d for d in self.history if d.ok and self.reduced(d)), None)
        if first is None:
            return least
        return least if self.full_depth_step(first) >= AUTO_STEP_S else None

    def full_depth_step(self, done: FinishedTrial) -> float:
        """A reduced-depth probe's step time scaled to the whole model by the layer count: an upper bound, since
        the per-step costs (the embedding, the head) do not grow with depth; it errs towards reducing."""
        return float(done.result["step_seconds"]) * self.shape.layers / layers_of(done)

    def reduced(self, done: FinishedTrial) -> bool:
        """Whether a trial ran fewer decoder layers than the model has (a probe at reduced depth)."""
        layers = layers_of(done)
        return layers is not None and layers < self.shape.layers

    def depth_of(self, done: FinishedTrial) -> int | None:
        """The layers a reduced-depth probe ran; None for a trial of the whole model."""
        return layers_of(done) if self.reduced(done) else None

    def ran(self, c: Candidate, layers: int | None) -> bool:
        """Whether c has a trial at this depth (None: the whole model) already."""
        return any(d.candidate == c and self.depth_of(d) == layers for d in self.history)

    def _widen_margin(self, done: FinishedTrial) -> None:
        """A config predicted to fit ran out of memory: trust the model less by what it missed."""
        pred = self.predict(done.candidate, update_margins=False, layers=self.depth_of(done))
        for res, measured, predicted in (("device", done.result.get("peak_device_bytes"), pred.device),
                                         ("host", done.result.get("peak_host_bytes"), pred.host)):
            if measured and predicted and measured > predicted:
                self.margins[res] = max(self.margins[res], measured / predicted - 1 + self.spec.search.margin)

    @property
    def tried(self) -> set[Candidate]:
        """Configs measured at full depth (a probe at reduced depth has not measured the model)."""
        return {d.candidate for d in self.history if not self.reduced(d)}

    @property
    def oom(self) -> list[tuple[Candidate, str]]:
        """Configs that ran out of memory, with what ran out ("device" unless a trial said "host")."""
        return [(d.candidate, d.result.get("oom_resource") or "device")
                for d in self.history if d.result["status"] == "oom"]

    def _needs_more(self, c: Candidate, o: Candidate, resource: str) -> bool:
        """Would c need at least as much of `resource` as o, which ran out of it? (Across backends: not known.)"""
        if c.backend != o.backend:
            return False
        if c.backend != "speedloader":      # a wrapped backend's peaks grow with b alone (dominates)
            return c == o or c.dominates(o)
        if resource == "host":   # host peaks grow with B and with (G+1)*B; more live blocks mean fewer groups;
            # offload holds every sub-batch's saved tensors on the host on top of recompute's boundary activations
            if c.activations != o.activations and c.activations != "offload":
                return False
            if (c.on_disk and not o.on_disk) or (c.weights_on_disk and not o.weights_on_disk):
                return False    # the master and optimizer state, or the weights and gradients, in files: less host

            groups = self.shape.groups
            return c.batch >= o.batch and \
                (groups(c.num_live_blocks) + 1) * c.batch >= (groups(o.num_live_blocks) + 1) * o.batch
        return c == o or c.dominates(o)

    def best(self, backend: str | None = None) -> FinishedTrial | None:
        """The fastest search trial measured ok at full depth (of `backend`; None: of any): never a diverged one."""
        ok = [d for d in self.history if d.ok and not self.reduced(d) and backend in (None, d.candidate.backend)]
        return max(ok, key=lambda d: d.tokens_per_s) if ok else None

    # -- predictions ---------------------------------------------------------------------------------
    def predict(self, c: Candidate, update_margins: bool = True, padded: bool = True,
                layers: int | None = None) -> Prediction:
        """Predicted peaks and throughput; `fits` allows each model's margin: the spec's safety margin plus
        what out-of-memory trials showed the model to miss. Unpadded, only the latter: whether the config
        may fit, where padded says it should. `layers`: at that depth (None: the whole model)."""
        v = self.vars(c, layers)
        dev, host = (self._peak(kind, v, c.backend) for kind in ("device", "host"))
        throughput = self.fits.get(fit_key(c.backend, "throughput"))
        t = throughput.predict(v) if throughput is not None else None
        tps = c.batch * self._new_tokens_per_row() / t if t and t > 0 else None
        hw = self.spec.hardware
        host_limit = min((x for x in (hw.host_memory_limit, self.host_ceiling) if x), default=None)
        pad = 0.0 if padded else self.spec.search.margin
        over = []
        if dev is not None and hw.device_memory_limit and \
                dev * (1 + self.margins["device"] - pad) > hw.device_memory_limit:
            over.append("device")
        if host is not None and host_limit and host * (1 + self.margins["host"] - pad) > host_limit:
            over.append("host")
        disk, disk_limit = v["prior_disk"], self.disk_limit
        if disk and disk_limit is not None and disk * (1 + self.margins["disk"] - pad) > disk_limit:
            over.append("disk")
        if "device" not in over and hw.device_memory_limit and c.backend == "speedloader" and \
                self.shape.min_device_bytes(self.spec.workload.mode, c.num_live_blocks,
                                            c.weights_on_device or 0.0) > hw.device_memory_limit:
            over.append("device")           # known without a fit: the kept weights beside a streamed unit
        for o, resource in self.oom:
            if resource not in over and self._needs_more(c, o, resource):
                over.append(resource)           # measured: a config needing no less already ran out
        return Prediction(dev, host, t, tps, fits=not over, over=over, prior_device=v["prior_device"],
                          prior_host=v["prior_host"], disk=disk or None, prior_step=self.step_prior(c, layers))

    @property
    def disk_limit(self) -> int | None:
        """What disk configs' files may take: hardware.disk_limit, and no more than the free space trials offload
        to."""
        return min((x for x in (self.spec.hardware.disk_limit, self.disk_ceiling) if x is not None), default=None)

    def _peak(self, kind: str, v: dict[str, float], backend: str = "speedloader") -> float | None:
        """A memory model's prediction: the fit (the prior corrected by the trials, once they pin every term
        down); before that the prior, scaled by the median ratio the trials so far measured to it (trials of the
        same backend)."""
        fit = self.fits.get(fit_key(backend, kind))
        got = fit.predict(v) if fit is not None else None
        if got is not None:
            return got
        prior = v[f"prior_{kind}"]
        ratios = [r["measured"] / r["vars"][f"prior_{kind}"] for r in (fit.residuals if fit else [])
                  if r.get("measured") and (r.get("vars") or {}).get(f"prior_{kind}")]
        return prior * float(np.median(ratios)) if ratios else prior

    def _new_tokens_per_row(self) -> int:
        w = self.spec.workload
        return w.seq_len if w.mode == "train" else w.new_tokens

    def uncertainty(self, backend: str | None = None) -> float:
        """Relative error to allow a throughput prediction (of `backend`'s configs; None: the space's first
        backend's): the typical (median) leave-one-out error of the robust fit, or 10% before there is one. (The
        largest is reported too, but it is one point's story: often the trial another process slowed, which the
        robust fit rightly discounts.)"""
        fit = self.fits.get(fit_key(backend or self.space.backends[0], "throughput"))
        loo = fit.loo_typical_error if fit is not None else None
        return 0.10 if loo is None else max(loo, 0.01)

    @staticmethod
    def noise(d: FinishedTrial) -> float:
        """A measurement's relative noise: the half-width of its 95% interval over its median (as measured:
        an unstable best must not end the search sooner)."""
        return 1.96 * rel_sigma(d.result, believe_unstable=True)

    def binding_limit(self, c: Candidate) -> str:
        """Which limit stops the next larger configs (one of the space's knobs one step up) from fitting."""
        up = self.space.neighbours_up(c)
        if not up:
            return "search-space"
        over: set[str] = set()
        for o in up:
            mine = self.predict(o).over
            over.update(mine)
            # over host: the same config with its optimizer (or its weights) on disk may fit; if none does, what stops
            # them (the disk, say) binds too
            twins = [t for t in (dataclasses.replace(o, optimizer_offload=x, param_offload=p)
                                 for x in self.space.offload_values for p in self.space.param_values)
                     if t != o and t in self.space and o.backend == "speedloader"]
            if "host" in mine and twins and not any(self.predict(t).fits for t in twins):
                over.update(r for t in twins for r in self.predict(t).over)
        return "+".join(sorted(over)) if over else "none"
