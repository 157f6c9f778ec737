"""The search strategies (sltune.tuning.search.strategies): the probes oneshot runs, what it measures next and
when it stops."""

from __future__ import annotations

import dataclasses

from sltune.tuning.cost.shape import shape_of
from sltune.tuning.search.state import FinishedTrial, SearchState
from sltune.tuning.search.strategies import OneShotStrategy, Stop
from sltune.tuning.space import Candidate, SearchSpace
from tests.support.backend_specs import ok, state_of
from tests.support.offload_specs import BOTH, OPTIMIZER, WEIGHTS, spec
from tests.support.search import state
from tests.support.specs import admitted_spec


def test_probes_come_from_real_candidates_in_awkward_spaces():
    from sltune.tuning.search.strategies import OneShotStrategy

    st = state(sub_batch_size=[3, 4, 5], num_sub_batches=None, effective_batch_size=[5, 12])
    probes = OneShotStrategy(st, 0).probes()
    assert probes and all(p in st.space.candidates for p in probes)


def test_oneshot_tries_the_fastest_config_when_only_the_safety_margin_rules_it_out():
    """The fastest config often peaks just under a limit (the grid's best in bench/noise.py (a): 1.8% under
    it). Predicted to fit only inside the 5% margin, it is still tried when it is the one predicted fastest;
    `fits` (what plan and export report) keeps the margin."""
    from sltune.tuning.search.strategies import OneShotStrategy

    s = 32
    def peak(c: Candidate) -> float:
        return 1e6 + 1e4 * c.sub_batch_size * s         # device memory grows with b only

    def step(c: Candidate) -> float:
        return 0.05 + 0.01 * c.num_sub_batches + 1e-4 * c.batch * s     # larger b and N: more tokens/s

    limit = int(peak(Candidate(4, 4, 1)) * 1.03)            # b=4 peaks 3% under the limit
    st = state(num_live_blocks=[1])
    st.spec = st.spec.model_copy(update={"hardware": st.spec.hardware.model_copy(
        update={"device_memory_limit": limit})})
    for i, c in enumerate(Candidate(b, n, 1) for b in (1, 2) for n in (1, 2, 4)):
        tps = c.batch * s / step(c)
        st.add(FinishedTrial(i, c, "probe", {"status": "ok", "tokens_per_s": tps, "step_seconds": step(c),
                                     "peak_device_bytes": peak(c), "peak_host_bytes": 1e6 + c.batch,
                                     "timing": {"steps_s": [step(c)] * 5,
                                                "tokens_per_s_ci95": [tps * 0.99, tps * 1.01]}}))
    fastest = Candidate(4, 4, 1)
    assert not st.predict(fastest).fits and st.predict(fastest, padded=False).fits
    proposal = OneShotStrategy(st, 0).propose()
    assert proposal.candidate == fastest, proposal


def test_oneshot_measures_a_frontier_config_its_throughput_model_cannot_predict_before_stopping():
    """Five probes fitted by six step-time features can predict a step time <= 0 far from them (a generate
    job saw 28 of 90 configs so, the winning corner b=16 N=1 among them, and stopped at a config 3x slower):
    those configs have no prediction, so the search cannot rule them out and measures the largest first."""
    from sltune.tuning.search.strategies import OneShotStrategy

    spec = admitted_spec({"name": "g", "model": {"preset": "llama-tiny"},
                          "workload": {"mode": "generate", "prompt_len": 8, "new_tokens": 8},
                          "search": {"sub_batch_size": [1, 4, 16], "effective_batch_size": 16,
                                     "num_live_blocks": [1, 4], "kv_cache": "device",
                                     "weights_on_device": [0, 0.5]}})
    shape = shape_of("llama-tiny")
    st = SearchState(spec, shape, SearchSpace(spec, shape))
    runs = [((1, 16, 1, 0.0), 10.26), ((1, 16, 4, 0.0), 8.39), ((4, 4, 1, 0.0), 5.54), ((4, 4, 4, 0.0), 4.58),
            ((1, 16, 1, 0.5), 2.0)]
    for i, ((b, n, k, w), t) in enumerate(runs):
        c = Candidate(b, n, k, "recompute", "device", w)
        tps = c.batch * 8 / t
        st.add(FinishedTrial(i, c, "probe", {"status": "ok", "tokens_per_s": tps, "step_seconds": t,
                                    "peak_device_bytes": 1e6 + 1e4 * b * k + 5e5 * w,
                                    "peak_host_bytes": 1e6 + c.batch,
                                    "timing": {"steps_s": [t] * 5, "tokens_per_s_ci95": [tps * 0.99, tps * 1.01]}}))
    st.add(FinishedTrial(5, Candidate(16, 1, 1, "recompute", "device", 0.5), "probe",
                         {"status": "failed", "error": "x"}))
    assert all(c in st.tried for c in OneShotStrategy(st, 0).probes())
    blind = [c for c in st.space.candidates if c not in st.tried and st.predict(c).tokens_per_s is None]
    assert Candidate(16, 1, 4, "recompute", "device", 0.5) in blind
    proposal = OneShotStrategy(st, 0).propose()
    assert proposal.candidate == Candidate(16, 1, 4, "recompute", "device", 0.5), proposal
    # once: after a frontier trial the blind configs rank as predicted nothing, and the search may stop
    st.add(FinishedTrial(6, proposal.candidate, "frontier", {"status": "failed", "error": "x"}))
    after = OneShotStrategy(st, 0).propose()
    assert getattr(after, "candidate", None) not in blind, after


def test_generation_probes_keep_the_most_weights_where_they_save_the_most():
    """The step-time fit sees kept weights as W/N: a probe at N=16 would give W/N = W/16 and let its noise,
    times 16, set the coefficient; the probe keeps the largest share at the fewest sub-batches."""
    from sltune.tuning.search.strategies import OneShotStrategy

    spec = admitted_spec({"name": "g", "model": {"preset": "llama-tiny"},
                          "workload": {"mode": "generate", "prompt_len": 8, "new_tokens": 8},
                          "search": {"sub_batch_size": [1, 4, 16], "effective_batch_size": 16,
                                     "num_live_blocks": [1, 4], "weights_on_device": [0, 0.5, 1]}})
    shape = shape_of("llama-tiny")
    probes = OneShotStrategy(SearchState(spec, shape, SearchSpace(spec, shape)), 0).probes()
    assert [c for c in probes if c.weights_on_device] == [Candidate(16, 1, 1, "recompute", "device", 1.0)]


def test_oneshot_probes_every_backend():
    st = state_of(backend=["speedloader", "deepspeed", "fsdp"])
    probes = OneShotStrategy(st, 0).probes()
    assert {c.backend for c in probes} == {"speedloader", "deepspeed", "fsdp"}
    assert all(c in st.space for c in probes)
    first = [c for c in probes if c.backend == "deepspeed"][0]
    assert first.backend_knobs() == {"zero_stage": 2, "offload_optimizer": "none", "offload_param": "none"}
    assert [c for c in OneShotStrategy(state_of(), 0).probes()] == OneShotStrategy(state_of(), 0).speedloader_probes(
        state_of().space.candidates)      # SpeedLoader alone: its probes as before


def test_oneshot_stops_only_when_no_config_of_any_backend_can_beat_the_best_allowing_its_own_models_error(
        monkeypatch):
    """Over several backends each config's prediction is allowed its own backend's model error: the top prediction
    (FSDP's, its model exact) falling short of the best must not end the search while a SpeedLoader config, whose
    model errs by 40%, may still beat it; and before that each backend's top predicted config is measured once
    (bench/backends.py: oneshot stopped after FSDP's and DeepSpeed's frontier trials and never measured a SpeedLoader
    config beyond its probes' b, whose fit erred by 1.3% among them; the grid's best was SpeedLoader's at b=4)."""
    st = state_of(backend=["speedloader", "fsdp"], fsdp={"cpu_offload": [False, True]})
    strategy = OneShotStrategy(st, 0)
    def batch(c):
        return c.sub_batch_size * (1 + 0.2 * c.num_sub_batches)

    law = {"speedloader": lambda c: 100.0 * batch(c) * (1 + 0.05 * c.num_live_blocks),
           "fsdp": lambda c: 130.0 * batch(c) * (0.95 if c.cpu_offload else 1.0)}
    while (p := strategy.propose()).role == "probe":
        st.add(ok(len(st.history), p.candidate, law[p.candidate.backend](p.candidate)))
    # first each backend's top predicted config, once: its fit from the probes alone extrapolates there
    assert p.candidate == Candidate(2, 2, 2), p
    st.add(dataclasses.replace(ok(len(st.history), p.candidate, law["speedloader"](p.candidate)), role="frontier"))
    p = strategy.propose()
    lucky = Candidate(2, 2, None, backend="fsdp", cpu_offload=False, reshard_after_forward=True)
    assert p.candidate == lucky, p
    st.add(dataclasses.replace(ok(len(st.history), lucky, 1.1 * law["fsdp"](lucky)), role="frontier"))  # the best
    options = strategy.frontier()
    preds = {c: st.predict(c).tokens_per_s for c in options}
    top = max(options, key=preds.get)
    assert top.backend == "fsdp" and preds[top] * 1.01 < st.best().tokens_per_s, preds
    sl = max((c for c in options if c.backend == "speedloader"), key=preds.get)
    assert preds[sl] * 1.4 > st.best().tokens_per_s * (1 + st.noise(st.best())) > preds[sl] * 1.01, preds
    errors = {"speedloader": 0.4, "fsdp": 0.01}
    monkeypatch.setattr(st, "uncertainty", lambda backend=None: errors[backend])
    assert strategy.propose().candidate == sl
    errors["speedloader"] = 0.01        # both models exact: nothing can beat the best, the search ends
    stop = strategy.propose()
    assert stop.kind == "converged" and "(1.0% (speedloader), 1.0% (fsdp))" in stop.reason, stop


def test_oneshot_probes_the_weights_on_disk_only_where_the_optimizer_on_disk_alone_is_over():
    s = spec(BOTH)
    shape = shape_of("llama-tiny", "bfloat16")
    st = SearchState(s, shape, SearchSpace(s, shape))
    assert all(c.offloads == 0 for c in OneShotStrategy(st, 0).probes())
    # a host limit between the two disk configs' priors: the probes keep the weights on disk
    limit = (st.prior(OPTIMIZER).host + st.prior(WEIGHTS).host) // 2
    limited = spec(BOTH, hardware={"host_memory_limit": limit})
    st = SearchState(limited, shape, SearchSpace(limited, shape))
    probes = OneShotStrategy(st, 0).probes()
    assert probes and all(c.weights_on_disk for c in probes if c.sub_batch_size == 1 and c.num_sub_batches == 1)
    assert st.predict(WEIGHTS).fits and not st.predict(OPTIMIZER).fits
    # what stops a config growing names the host when its weights back in host memory would not fit
    assert "host" in st.binding_limit(WEIGHTS)


def guided(spec_search: dict | None = None, **changes) -> SearchState:
    """A SpeedLoader and FSDP space on a machine with rates (tests.support.rates): oneshot guided by the step-time
    prior."""
    from tests.support.backend_specs import KNOBS, SHAPE, parse
    from tests.support.rates import rates_for

    spec = parse({**KNOBS, "sub_batch_size": [1, 2, 4], "num_sub_batches": [1, 2, 4],
                  "backend": ["speedloader", "fsdp"], **(spec_search or {})})
    return SearchState(spec, SHAPE, SearchSpace(spec, SHAPE), rates=rates_for(seq=32, **changes))


# the machine the guided tests' trials run on: each backend's step its own multiple of the prior's plus a fixed cost
# per sub-batch (what sltune.tuning.cost.correction fits), FSDP's prior far more optimistic than SpeedLoader's
LAW = {"speedloader": (1.3, 0.002), "fsdp": (2.5, 0.004)}


def run(st: SearchState, c: Candidate, number: int, role: str = "frontier") -> FinishedTrial:
    factor, fixed = LAW[c.backend]
    step = factor * st.step_prior(c, corrected=False).seconds + fixed * c.num_sub_batches
    done = ok(number, c, c.batch * 32 / step)
    return dataclasses.replace(done, role=role)


def test_guided_by_the_step_time_prior_oneshot_measures_each_backend_s_top_then_stops_at_the_measured_best():
    """With the machine's rates (search.step_prior), oneshot runs no probes: it measures each backend's top predicted
    config first (the fastest predicted backend first), then the top predicted config as its backend's trials correct
    the prior, and stops once none can beat the best measured, allowing the correction's error. Its pick is the
    fastest config of the whole space on this machine, from a fraction of its trials."""
    st = guided()
    strategy = OneShotStrategy(st, 0)
    assert st.guided
    before = {c: st.step_prior(c).tokens_per_s for c in st.space.candidates}
    tops = {b: max((c for c in st.space.candidates if c.backend == b), key=lambda c: (before[c], c.batch,
                                                                                      c.sub_batch_size))
            for b in st.space.backends}
    proposed = []
    while not isinstance(p := strategy.propose(), Stop):
        assert p.role == "frontier" and p.layers is None and p.candidate not in st.tried
        proposed.append(p.candidate)
        st.add(run(st, p.candidate, len(st.history)))
    assert proposed[:2] == sorted(tops.values(), key=lambda c: -before[c])     # each backend's top, fastest first
    truth = {c: run(st, c, 0).tokens_per_s for c in st.space.candidates}
    assert st.best().candidate == max(truth, key=truth.get)
    assert len(proposed) <= len(st.space.candidates) // 4, (len(proposed), len(st.space.candidates))
    assert p.kind == "converged" and "allowing the corrected step-time prior's error" in p.reason, p
    assert "(speedloader)" in p.reason and "(fsdp)" in p.reason


def test_a_backend_whose_top_runs_out_of_memory_is_measured_at_its_next_top_before_the_search_may_stop():
    st = guided()
    strategy = OneShotStrategy(st, 0)
    first = strategy.propose().candidate
    st.add(FinishedTrial(0, first, "frontier", {"status": "oom", "oom_resource": "device", "error": "x"}))
    again = strategy.propose().candidate
    assert again.backend == first.backend and again != first and not again.dominates(first)
    assert not st.predict(first).fits


def test_oneshot_probes_as_before_without_rates_with_step_prior_off_or_rates_that_lack_a_kind_of_work():
    assert not state_of().guided
    assert not guided({"step_prior": "off"}).guided
    probes = OneShotStrategy(guided({"step_prior": "off"}), 0)
    assert probes.propose().role == "probe"
    from tests.support.backend_specs import SHAPE, parse
    from tests.support.rates import rates_for

    spec = parse({"sub_batch_size": [1, 2], "num_sub_batches": [1, 2], "num_live_blocks": [1]}, workload={
        "mode": "generate", "prompt_len": 8, "new_tokens": 4})
    # generation is guided by rates calibrated at a generate spec, not by a training spec's (no decode attention)
    st = SearchState(spec, SHAPE, SearchSpace(spec, SHAPE), rates=rates_for(seq=32))
    assert st.guided and OneShotStrategy(st, 0).propose().role == "frontier"
    assert not SearchState(spec, SHAPE, SearchSpace(spec, SHAPE), rates=rates_for(seq=32, decode_attention=[])).guided


def test_with_trials_in_flight_oneshot_proposes_the_probes_they_are_not_and_then_waits():
    """hardware.parallel_trials: asked again while probes run, oneshot proposes each other probe once, the same ones
    it proposes one at a time; past them it waits (None) for the trials in flight, whose results its next choice
    reads; with none in flight it goes on as before."""
    from sltune.tuning.search.strategies import OneShotStrategy

    st = state()
    strategy = OneShotStrategy(st, 0)
    pending = []
    while (p := strategy.propose(pending)) is not None:
        assert p.role == "probe" and (p.candidate, p.layers) not in pending
        pending.append((p.candidate, p.layers))
    assert [c for c, _ in pending] == [c for c in strategy.probes() if st.predict(c).fits]
    for i, (c, _) in enumerate(pending):
        st.add(ok(i, c, 100.0 * c.batch))
    assert strategy.propose() is not None and strategy.propose(pending[:1]) is None


def test_with_trials_in_flight_the_grid_proposes_the_configs_they_are_not_and_stops_once_they_are_done():
    from sltune.tuning.search.strategies import GridStrategy

    st = state(num_live_blocks=[1])
    grid = GridStrategy(st, 0)
    pending = []
    while (p := grid.propose(pending)) is not None:
        assert not isinstance(p, Stop)
        pending.append((p.candidate, None))
    assert [c for c, _ in pending] == st.space.candidates and grid.propose(pending) is None
    for i, (c, _) in enumerate(pending):
        st.add(ok(i, c, 100.0))
    assert isinstance(grid.propose(), Stop)


def test_guided_oneshot_never_starts_a_trial_its_predicted_steps_would_time_out_and_says_so_when_none_is_left():
    """A config whose trial is predicted to outlast search.trial_timeout_s (SearchState.trial_seconds: its steps and
    one more at its predicted step, allowing the prior's error) would likely only time out: bfloat16 qwen2-0.5b on a
    CPU without bfloat16 matmuls was predicted at 0.4 tokens/s, and the guided search still started it, then its next
    top, each stopped after 300 s."""
    quick = guided()
    predicted = {c: quick.trial_seconds(c) for c in quick.space.candidates}
    timeout = sorted(predicted.values())[len(predicted) // 2]     # half the space would time out
    st = guided({"trial_timeout_s": timeout})
    strategy = OneShotStrategy(st, 0)
    proposed = []
    while not isinstance(p := strategy.propose(), Stop):
        assert predicted[p.candidate] <= timeout, (p.candidate, predicted[p.candidate], timeout)
        proposed.append(p.candidate)
        st.add(run(st, p.candidate, len(st.history)))
    assert proposed and p.kind == "converged", p
    assert p.reason.endswith("more would outlast search.trial_timeout_s " f"{timeout:g}s"), p.reason
    fastest_in_time = max((c for c in predicted if predicted[c] <= timeout and quick.predict(c, padded=False).fits),
                          key=lambda c: quick.step_prior(c).tokens_per_s)
    assert proposed[0].backend == fastest_in_time.backend or fastest_in_time in proposed

    none_in_time = OneShotStrategy(guided({"trial_timeout_s": min(predicted.values()) / 2}), 0).propose()
    assert isinstance(none_in_time, Stop) and none_in_time.kind == "too_slow"
    assert none_in_time.reason.startswith("no trial ran: every untried config that fits is predicted to outlast "
                                          "search.trial_timeout_s"), none_in_time.reason
    assert "raise search.trial_timeout_s past that" in none_in_time.reason and "workload.seq_len" in none_in_time.reason
