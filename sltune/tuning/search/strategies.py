"""Search strategies behind one interface, chosen by name: oneshot (the default), grid, random, tpe.

Every strategy runs through Optuna: each trial is an Optuna trial in the job's study. The baselines let
Optuna's samplers choose; oneshot chooses itself (from its fitted models) and enqueues its choice.

A job may run several trials at once (hardware.parallel_trials): propose is then asked again while trials are in
flight (`pending`), and proposes only what does not wait on their results, or None until one finishes: the grid's and
the samplers' next configs, oneshot's probes and each backend's first guided trial; oneshot's later choices read the
fits of every trial before them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection
from dataclasses import dataclass
from typing import Literal

import numpy as np
import optuna

from sltune.tuning.search.fit import FEATURES, split_key
from sltune.tuning.search.state import CHEAPER_STEP, SearchState
from sltune.tuning.space import Candidate


@dataclass
class Proposal:
    candidate: Candidate | None     # None: let the Optuna sampler choose
    role: str
    layers: int | None = None       # decoder layers to run (a probe at reduced depth); None: the whole model


@dataclass(frozen=True)
class Stop:
    """Nothing more is worth a trial: every candidate has run ("exhausted"), or none untried is predicted to fit and
    be faster than the best ("converged"), or every one left is predicted to outlast search.trial_timeout_s or the
    time budget's rest ("too_slow"). The runner ends the search with it; reason is the job's stop_reason."""
    kind: Literal["exhausted", "converged", "too_slow"]
    reason: str


# what is in flight when a strategy proposes: each running trial's config and depth (Proposal.layers)
Pending = Collection[tuple[Candidate, "int | None"]]


class Strategy:
    name = "base"

    def __init__(self, state: SearchState, seed: int):
        self.state = state
        self.seed = seed

    def sampler(self) -> optuna.samplers.BaseSampler:
        return optuna.samplers.RandomSampler(seed=self.seed)

    def propose(self, pending: Pending = ()) -> Proposal | Stop | None:
        """The next trial, or why there is none; None: nothing until a trial in flight finishes."""
        if self.state.tried | {c for c, _ in pending} >= set(self.state.space.candidates):
            return None if pending else Stop("exhausted", "every candidate has been tried")
        return Proposal(None, self.name)


class RandomStrategy(Strategy):
    name = "random"


class TPEStrategy(Strategy):
    name = "tpe"

    def sampler(self) -> optuna.samplers.BaseSampler:
        # constant_liar: trials in flight count as bad ones, so trials proposed side by side differ
        return optuna.samplers.TPESampler(seed=self.seed, n_startup_trials=5, constant_liar=True)


class _EnqueuedGrid(optuna.samplers.GridSampler):
    """Optuna's grid sampler for a study whose every trial the runner enqueues (the grid strategy proposes
    each candidate itself, in order). Optuna's end-of-grid bookkeeping after a trial looks up a grid id that
    enqueued trials never get (a KeyError once a single grid point is left: a one-config grid failed after its
    trial had run) and would stop a study driven by ask and tell; the strategy knows when the grid is done."""

    def after_trial(self, study, trial, state, values) -> None:
        return None


class GridStrategy(Strategy):
    """Exhaustive: every candidate once (combinations that are not candidates are pruned unrun)."""

    name = "grid"

    def sampler(self) -> optuna.samplers.BaseSampler:
        return _EnqueuedGrid(self.state.space.grid(), seed=self.seed)

    def propose(self, pending: Pending = ()) -> Proposal | Stop | None:
        busy = {c for c, _ in pending}
        untried = [c for c in self.state.space.candidates if c not in self.state.tried and c not in busy]
        if not untried:
            return None if pending else Stop("exhausted", "every candidate has been tried")
        return Proposal(untried[0], "grid")   # in order, so an interrupted grid resumes where it stopped


class OneShotStrategy(Strategy):
    """A few probes make the resource and throughput fits well-posed; then only configs predicted to
    fit, on the frontier of the largest feasible ones, best predicted throughput first, until no untried
    one is predicted (allowing for the model's typical leave-one-out error) to beat the best by more than
    the best's own measured noise: a smaller predicted gain could not be told from noise anyway. A frontier
    config the throughput model cannot predict (a step time <= 0, which a few probes fitted exactly can give
    far from them) cannot be ruled out by it: the largest such config is measured before the first frontier
    trial, once, so the model sees beyond the probes before the search may stop.

    A config predicted to fit only inside the safety margin (within 5% of a limit, say) is tried too when
    it is the one predicted fastest: the fastest config often sits right at a limit (the grid's best in
    bench/noise.py (a) peaked 1.8% under it), a trial that runs out of memory costs one short trial and
    teaches the model its error, and a pick is always a measured config, whose peak is known.

    With search.probe_layers the probes run fewer layers (sltune.tuning.search.probes) and every other trial the whole
    model; the search then ends only once two configs have run at full depth, so that the pick has a measured
    rival (the probes measured a smaller model).

    Sweeping several backends (search.backend), each is probed and fitted on its own (sltune.tuning.search.fit's
    BACKEND_MODELS), and the frontier is every backend's: each backend's top predicted config is measured once
    (its fit extrapolates beyond its probes there), and the search goes on while any config of any backend is
    predicted to beat the best, allowing its own backend's model error.

    On a machine with calibrated rates (search.step_prior; SearchState.guided) none of that: the step-time prior ranks
    the whole space before any trial, and the search measures its top predictions (by_prior)."""

    name = "oneshot"

    def probes(self) -> list[Candidate]:
        """Each backend's probes, in search.backend's order."""
        space = self.state.space
        plan: list[Candidate | None] = []
        for backend in space.backends:
            cands = space.of_backend(backend)
            plan += self.speedloader_probes(cands) if backend == "speedloader" else self.wrapped_probes(cands)
        return [c for c in dict.fromkeys(plan) if c is not None]

    def wrapped_probes(self, cands: list[Candidate]) -> list[Candidate | None]:
        """A wrapped backend's: its first knob combination (the spec's first values) at the corners of b and at a
        larger N, and each other combination once at the least b; the fits' rank probes add what they still lack."""
        bs = sorted({c.sub_batch_size for c in cands})
        b_lo, b_mid = bs[0], bs[len(bs) // 2]
        variants = list(dict.fromkeys(tuple(c.backend_knobs().items()) for c in sorted(cands, key=_spec_order)))

        def cheapest(b: int, variant: tuple, at_least: int = 0) -> Candidate | None:
            fits = [c for c in cands if c.sub_batch_size == b and tuple(c.backend_knobs().items()) == variant
                    and c.num_sub_batches >= at_least]
            return min(fits, key=lambda c: c.batch, default=None)

        plan = [cheapest(b, variants[0]) for b in (b_lo, b_mid)]
        if not self.state.space.by_batch:
            ns = sorted({c.num_sub_batches for c in cands if c.sub_batch_size == b_lo})
            plan.append(cheapest(b_lo, variants[0], at_least=ns[len(ns) // 2]))
        return plan + [cheapest(b_lo, v) for v in variants[1:]]

    def speedloader_probes(self, cands: list[Candidate]) -> list[Candidate | None]:
        """SpeedLoader's: cheap configs at the corners of (b, k), and at a larger N: enough to pin every model
        down."""
        bs, ks = sorted({c.sub_batch_size for c in cands}), sorted({c.num_live_blocks for c in cands})
        b_lo, b_mid = bs[0], bs[len(bs) // 2]

        def cheapest(b: int, k: int, at_least: int = 0, w: float | None = None) -> Candidate | None:
            # the optimizer (then the weights) in host memory where that is predicted to fit, else on disk
            # (search.optimizer_offload, search.param_offload)
            fits = [c for c in cands if c.sub_batch_size == b and c.num_live_blocks == k
                    and c.num_sub_batches >= at_least and (w is None or c.weights_on_device == w)]
            return min(fits, key=lambda c: (c.batch, not self._placed(c), c.offloads), default=None)

        plan = [cheapest(b, k) for b in (b_lo, b_mid) for k in (ks[0], ks[-1])]
        if not self.state.space.by_batch:
            ns = sorted({c.num_sub_batches for c in cands if c.sub_batch_size == b_lo})
            plan += [cheapest(b_lo, k, at_least=ns[len(ns) // 2]) for k in (ks[0], ks[-1])]
        shares = sorted({c.weights_on_device for c in cands if c.weights_on_device is not None})
        if shares and shares[-1] > 0:
            # generation: the most weights kept, where they save the most (the fewest sub-batches: W/N in the
            # step-time fit); measured at many sub-batches instead, W/N is tiny and its noise sets the fit
            fewest = min(cands, key=lambda c: (c.num_sub_batches, c.sub_batch_size))
            plan.append(cheapest(fewest.sub_batch_size, ks[0], w=shares[-1]))
        return plan

    def _placed(self, c: Candidate) -> bool:
        """Whether c is where its config probes among its places (the optimizer and the weights in host memory or in
        files): the fewest files predicted to fit (the optimizer on disk before the weights), else all in host
        memory. A space without such choices has one place: every config is placed."""
        places = sorted((t for t in (dataclasses.replace(c, optimizer_offload=o, param_offload=p)
                                     for o in ("host", "disk") for p in ("host", "disk")) if t in self.state.space),
                        key=lambda t: (t.offloads, t.weights_on_disk))
        if len(places) < 2:
            return True
        return c == next((t for t in places if self.state.predict(t).fits), places[0])

    def propose(self, pending: Pending = ()) -> Proposal | Stop | None:
        st = self.state
        if st.guided:
            return self.by_prior(pending)
        depth = st.probe_layers()        # search.probe_layers: probes at reduced depth, the rest at full depth
        for c in self.probes():
            if not st.ran(c, depth) and (c, depth) not in pending and st.predict(c).fits:
                return Proposal(c, "probe", depth)
        if pending:
            return None                 # what follows the probes reads the fits of every trial before it
        if not st.fits or not all(f.well_posed for f in st.fits.values() if f.features):
            extra = self._rank_probe(depth)
            if extra is not None:
                return Proposal(extra, "probe", depth)
        options = self.frontier()
        options += [c for c in self.frontier(padded=False) if c not in options]
        if not options:
            return Stop("converged", "no untried config is predicted to fit and to be faster")
        preds = {c: st.predict(c).tokens_per_s for c in options}
        blind = [c for c in options if preds[c] is None]
        if blind and not any(d.role == "frontier" for d in st.history):
            # the fitted probes fail there (a step time <= 0): the largest is measured once, so that the model
            # sees beyond the probes; only once, which bounds what a poor fit costs in trials
            return Proposal(max(blind, key=lambda c: (c.batch, c.sub_batch_size, c.kv_on_device,
                                                      c.weights_on_device or 0.0, c.num_live_blocks or 0)), "frontier")
        preds = {c: p or 0.0 for c, p in preds.items()}

        def rank(c: Candidate) -> tuple:
            """By predicted tokens/s, ties to the larger batch, then the larger rows per sub-batch."""
            return preds[c], c.batch, c.sub_batch_size

        if len(st.space.backends) > 1:
            # over several backends, each one's fit from its probes alone is extrapolated on its frontier (a small
            # leave-one-out error among the probes says nothing of b beyond them): before backends are compared,
            # each one's top predicted config is measured once
            unseen = [b for b in st.space.backends if not any(d.role == "frontier" and d.candidate.backend == b
                                                               for d in st.history)]
            for backend in unseen:
                own = [c for c in options if c.backend == backend]
                if own:
                    return Proposal(max(own, key=rank), "frontier")
        best = st.best()
        noise = st.noise(best) if best is not None else 0.0
        # each config allowing its own backend's model error: over several backends a less certain model's config
        # can still beat the best when the top prediction, another backend's, cannot
        hopeful = [c for c in options if best is None or
                   preds[c] * (1 + st.uncertainty(c.backend)) > best.tokens_per_s * (1 + noise)]
        top = max(hopeful or options, key=rank)
        rival = len({d.candidate for d in st.history if d.ok and not st.reduced(d)}) >= 2 or \
            not any(st.reduced(d) for d in st.history)
        if best is not None and not hopeful and rival:
            # (after probes at reduced depth, the search's best has a rival measured at full depth, the next best
            # predicted, for the confirmation round to weigh it against: the probes measured another model)
            errors = ", ".join(f"{st.uncertainty(b):.1%}" + (f" ({b})" if len(st.space.backends) > 1 else "")
                               for b in st.space.backends if any(c.backend == b for c in options))
            return Stop("converged", f"no untried config is predicted to beat the best ({best.tokens_per_s:.1f} "
                        f"tokens/s) by more than its measured noise (±{noise:.1%}), allowing the throughput model's "
                        f"typical error ({errors})")
        return Proposal(top, "frontier")

    def by_prior(self, pending: Pending = ()) -> Proposal | Stop | None:
        """Guided by the step-time prior (SearchState.guided): no probes. Every untried config that may fit is ranked
        by its predicted tokens/s, the prior corrected by its backend's trials so far (sltune.tuning.cost.correction).
        Each backend that has one is measured first at its top predicted config (the fastest backend first), so the
        answer across backends is measured, not assumed; then the top predicted config, until none, allowing its
        backend's correction error (SearchState.prior_error) and the spread of the machine's rates, is predicted to
        beat the best measured by more than the best's own noise. With trials in flight, only the first trials of
        backends none of them runs: the rest is ranked on their results."""
        st = self.state
        busy = {c for c, _ in pending}
        fitting = [c for c in st.space.candidates
                   if c not in st.tried and c not in busy and st.predict(c, padded=False).fits]
        if not fitting:
            if pending:
                return None
            return Stop("converged", "no untried config is predicted to fit")
        timeout, left = st.spec.search.trial_timeout_s, st.seconds_left() if st.seconds_left else None
        limit = timeout if left is None else min(timeout, left)
        options = [c for c in fitting if st.trial_seconds(c) <= limit]
        if not options:
            return None if pending else _too_slow(st, fitting, timeout, left)
        steps = {c: st.step_prior(c) for c in options}

        def rank(c: Candidate) -> tuple:
            """By predicted tokens/s, ties to the larger batch, then the larger rows per sub-batch."""
            return steps[c].tokens_per_s, c.batch, c.sub_batch_size

        def unmeasured(backend: str) -> bool:
            # a backend whose first tries all failed (ran out of memory, say) is left to the ranking below
            return st.best(backend) is None and sum(d.candidate.backend == backend for d in st.history) < FIRST_TRIES

        tops = [c for b in st.space.backends if unmeasured(b) and all(p.backend != b for p in busy)
                for c in [max((c for c in options if c.backend == b), key=rank, default=None)] if c is not None]
        if tops:
            return Proposal(max(tops, key=rank), "frontier")
        if pending:
            return None
        best = st.best()
        noise = st.noise(best) if best is not None else 0.0

        def at_most(c: Candidate) -> float:
            """The most tokens/s c may run at: its prediction allowing the correction's error, or the rates' fastest
            samples, whichever is more."""
            t = steps[c]
            return max(t.tokens_per_s * (1 + st.prior_error(c.backend)), t.tokens / t.fastest)

        hopeful = [c for c in options if best is None or at_most(c) > best.tokens_per_s * (1 + noise)]
        if not hopeful:
            errors = ", ".join(f"{st.prior_error(b):.0%}" + (f" ({b})" if len(st.space.backends) > 1 else "")
                               for b in st.space.backends if any(c.backend == b for c in options))
            slow = len(fitting) - len(options)
            return Stop("converged", f"no untried config is predicted to beat the best ({best.tokens_per_s:.1f} "
                        f"tokens/s) by more than its measured noise (±{noise:.1%}), allowing the corrected "
                        f"step-time prior's error ({errors})" + (
                            f"; {slow} more would outlast search.trial_timeout_s {timeout:g}s"
                            + (" or the time left" if left is not None else "") if slow else ""))
        return Proposal(max(hopeful, key=rank), "frontier")

    def frontier(self, padded: bool = True) -> list[Candidate]:
        """Untried configs predicted to fit that no other fitting config (tried or not) dominates at the
        same live-block count and share of kept weights: throughput rises with b and B, so a dominated config
        cannot be best. Kept weights need more memory but are not always faster: on the CPU keeping all of
        llama-small's ran 0.86x at b=1 N=16 (a unit copied just before 16 sub-batches read it is read from
        cache) and 1.39x at b=16 N=1, so each share keeps its own frontier."""
        st = self.state
        fitting = [c for c in st.space.candidates if st.predict(c, padded=padded).fits and
                   (c not in st.tried or any(d.ok and d.candidate == c and not st.reduced(d) for d in st.history))]
        out = []
        for c in fitting:
            if c in st.tried:
                continue
            if not any(o.num_live_blocks == c.num_live_blocks and o.weights_on_device == c.weights_on_device
                       and o.dominates(c) for o in fitting):
                out.append(c)
        return out

    def _rank_probe(self, depth: int | None = None) -> Candidate | None:
        """When probes ran out of memory or were too few to pin a model down: the untried config (at the probes'
        depth), predicted to fit, that adds the most rank to the models still underdetermined; the cheapest such
        one."""
        st = self.state
        options = [c for c in st.space.candidates if not st.ran(c, depth) and st.predict(c).fits]
        # the models' features are the knobs' terms, never the prior's peaks (as SearchState._varying reads them);
        # each backend's models are fitted to its own trials, so a config adds rank to its backend's alone
        ok = {b: [st.vars(d.candidate, st.depth_of(d), prior=False) for d in st.fitted() if d.candidate.backend == b]
              for b in st.space.backends}
        lacking = {k: st.features[k] for k, f in st.fits.items() if f.features and not f.well_posed} \
            or dict(st.features)
        have = {k: _rank(ok[split_key(k)[0]], feats) for k, feats in lacking.items()}

        def gain(c: Candidate) -> int:
            return sum(_rank(ok[c.backend] + [st.vars(c, depth, prior=False)], feats) - have[k]
                       for k, feats in lacking.items() if split_key(k)[0] == c.backend)

        scored = [(gain(c), c) for c in options]
        scored = [(g, c) for g, c in scored if g > 0]
        if not scored:
            return None
        def cheapest(gc: tuple[int, Candidate]) -> tuple:
            gained, c = gc
            return -gained, c.sub_batch_size * (c.num_live_blocks or 1), c.batch, c.num_live_blocks or 0

        return min(scored, key=cheapest)[1]


# The trials a backend gets at its top predicted configs before the search may stop without it (each one that runs out
# of memory rules out every config needing more, so the next is smaller)
FIRST_TRIES = 3


def _too_slow(st: SearchState, fitting: list[Candidate], timeout: float, left: float | None) -> Stop:
    """Every config left that fits would time out, or outlast the time budget's rest (`left`): the quickest one's
    predicted step, and what would make it run."""
    quickest = min(fitting, key=st.trial_seconds)
    t, s = st.step_prior(quickest), st.spec.search
    if left is not None and st.trial_seconds(quickest) <= timeout:
        return Stop("too_slow", f"the {max(left, 0):.0f}s left of search.time_budget_s {s.time_budget_s:g}s are "
                                f"fewer than any untried config's trial is predicted to take (the quickest, "
                                f"{quickest}, {st.trial_seconds(quickest):.0f}s)")
    most = max(t.breakdown, key=t.breakdown.get)
    return Stop("too_slow", (
        ("" if st.history else "no trial ran: ") + "every untried config that fits is predicted to outlast "
        f"search.trial_timeout_s {timeout:g}s on this machine: the quickest, {quickest}, steps in {t.seconds:.3g}s "
        f"[{t.fastest:.3g}, {t.slowest:.3g}] ({most} {t.breakdown[most] / t.seconds:.0%}), and its trial "
        f"{st.trial_seconds(quickest):.3g}s ({1 + s.trial_steps + s.profile} steps, its start and its parity check); "
        f"raise search.trial_timeout_s past that, or make a step cheaper ({CHEAPER_STEP})"))


def _spec_order(c: Candidate) -> tuple:
    """A wrapped backend's candidates in the order of the spec's knob values (Candidate's own order sorts them by
    value, "cpu" before "none"), so its first combination is the spec's first values: the least offloaded."""
    return tuple(0 if v in (2, "none", False) else 1 if v in (3, "cpu", True) else 2
                 for v in c.backend_knobs().values())


def _rank(rows: list[dict[str, float]], features: list[str]) -> int:
    if not rows:
        return 0
    x = np.array([[FEATURES[f](v) for f in features] for v in rows], dtype=float)
    return int(np.linalg.matrix_rank(x / np.maximum(np.abs(x).max(axis=0), 1e-300)))


STRATEGIES: dict[str, type[Strategy]] = {s.name: s for s in (OneShotStrategy, GridStrategy, RandomStrategy,
                                                              TPEStrategy)}
