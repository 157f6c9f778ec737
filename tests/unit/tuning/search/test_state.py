"""What a search knows after some trials (sltune.tuning.search.state): the prior predicts before any trial and the
trials correct it; what out-of-memory trials rule out and which limit binds; each backend fitted to its own trials;
a diverged trial never the best."""

import pytest

from sltune.tuning.cost.shape import shape_of
from sltune.tuning.report.result import job_result
from sltune.tuning.search.confirm import ranked, winner_of
from sltune.tuning.search.state import FinishedTrial, SearchState
from sltune.tuning.space import Candidate, SearchSpace
from tests.support.backend_specs import KNOBS, SHAPE, fsdp, ok, parse, state_of
from tests.support.rates import rates_for
from tests.support.search import state
from tests.support.specs import admitted_spec


def oom(c: Candidate, resource: str) -> FinishedTrial:
    return FinishedTrial(0, c, "probe", {"status": "oom", "oom_resource": resource, "error": "x"})


def test_a_device_oom_rules_out_configs_needing_no_less_device_memory():
    st = state()
    st.add(oom(Candidate(2, 2, 2), "device"))
    assert st.predict(Candidate(4, 2, 2)).over == ["device"]
    assert st.predict(Candidate(2, 2, 4)).over == ["device"]
    assert st.predict(Candidate(2, 2, 1)).fits and st.predict(Candidate(1, 4, 2)).fits


def test_a_host_oom_does_not_rule_out_more_live_blocks():
    """Host peaks grow with B and (G+1)*B: more live blocks means fewer groups and less host memory."""
    st = state()
    st.add(oom(Candidate(2, 2, 1), "host"))
    assert st.predict(Candidate(2, 4, 1)).over == ["host"]       # larger batch, same groups
    assert st.predict(Candidate(2, 2, 4)).fits                     # same batch, fewer groups
    assert st.predict(Candidate(4, 2, 2)).over == ["host"]        # B=8 with (G+1)=3: 24 >= 4*5=20


def test_binding_limit_steps_along_the_spec_knobs():
    st = state()
    assert set(st.space.neighbours_up(Candidate(2, 2, 1))) == {Candidate(4, 2, 1), Candidate(2, 4, 1),
                                                               Candidate(2, 2, 2)}
    st.add(oom(Candidate(4, 2, 1), "device"))
    assert st.binding_limit(Candidate(2, 2, 1)) == "device"
    assert st.binding_limit(Candidate(4, 4, 4)) == "search-space"


def test_each_backend_is_fitted_to_its_own_trials_under_its_own_names():
    alone = state_of()
    assert list(alone.models) == ["device", "host", "throughput"]       # a SpeedLoader job's, as before
    st = state_of(backend=["speedloader", "fsdp"])
    assert list(st.models) == ["device", "host", "throughput", "fsdp.device", "fsdp.host", "fsdp.throughput"]
    assert "[cpu_offload]" in st.features["fsdp.device"] and "k" not in st.features["fsdp.device"]
    for i, c in enumerate([fsdp(1, 1), fsdp(2, 1), fsdp(1, 2), fsdp(1, 1, cpu=True), fsdp(1, 2, cpu=True),
                           Candidate(1, 1, 1)]):
        st.add(ok(i, c, 1000.0 * c.batch / (1 + 0.1 * c.num_sub_batches)))
    assert st.fits["fsdp.throughput"].n == 5 and st.fits["throughput"].n == 1 and st.fits["fsdp.device"].n == 5
    assert st.predict(fsdp(2, 1, cpu=True)).tokens_per_s is not None     # fitted on fsdp's trials alone


def test_a_diverged_trial_is_never_the_best_of_the_search_its_backend_or_the_confirmation():
    st = state_of(backend=["speedloader", "fsdp"])
    fast_but_wrong = ok(0, fsdp(2, 2), 9000.0, status="diverged")
    st.add(fast_but_wrong)
    st.add(ok(1, Candidate(2, 2, 1), 3000.0))
    st.add(ok(2, Candidate(1, 1, 1), 1000.0))
    assert st.best().candidate == Candidate(2, 2, 1) and st.best("fsdp") is None
    assert fast_but_wrong not in ranked(st) and winner_of(st, None).candidate == Candidate(2, 2, 1)
    assert all(d.result["status"] == "ok" for d in st.fitted())
    r = job_result("j", st.spec, st, "done", 1.0)
    assert r["best"]["trial_number"] == 1 and r["best"]["config"]["backend"] == "speedloader"
    assert list(r["best_by_backend"]) == ["speedloader"]       # fsdp ran, but never correctly: no pick of it
    st.add(ok(3, fsdp(1, 1), 800.0))
    r = job_result("j", st.spec, st, "done", 1.0)
    assert r["best_by_backend"]["fsdp"]["trial_number"] == 3
    assert r["best_by_backend"]["fsdp"]["config"] == {**fsdp(1, 1).knobs(), "schedule": None}
    assert r["best_by_backend"]["speedloader"]["trial_number"] == r["best"]["trial_number"]


def tiny_state(**hardware) -> SearchState:
    spec = admitted_spec({"name": "p", "model": {"preset": "llama-tiny"}, "workload": {"seq_len": 32},
                          "hardware": hardware, "search": {"sub_batch_size": [1, 2, 4], "num_sub_batches": [1, 2, 4],
                                                           "num_live_blocks": [1, 2]}})
    shape = shape_of("llama-tiny")
    return SearchState(spec, shape, SearchSpace(spec, shape), baseline=300 * 2**20)


def measured(st: SearchState, c: Candidate, device: float, host: float, number: int = 0) -> FinishedTrial:
    return FinishedTrial(number, c, "probe", {"status": "ok", "tokens_per_s": 100.0, "step_seconds": 1.0,
                                     "peak_device_bytes": device, "peak_host_bytes": host})


def test_the_prior_alone_predicts_before_any_trial_and_the_trials_correct_it():
    st = tiny_state()
    c = Candidate(4, 4, 2)
    before = st.predict(c)
    prior = st.prior(c)
    assert (before.device, before.host) == (prior.device, prior.host) and before.prior_host == prior.host
    assert prior.host > 300 * 2**20      # the process is a term of it
    # one trial that measured 10% more than its prior: too few to fit every term, so the prior is scaled by it
    probe = Candidate(1, 1, 1)
    st.add(measured(st, probe, 1.1 * st.prior(probe).device, 1.1 * st.prior(probe).host))
    assert st.predict(c).device == pytest.approx(1.1 * prior.device)
    # enough trials to pin every term: what they measure beyond the prior is fitted, so a measured residual linear
    # in the knobs is predicted exactly where no trial ran
    def extra(x: Candidate) -> float:
        return 5e4 + 3e3 * x.sub_batch_size * 32 + 2e3 * x.num_live_blocks

    st = tiny_state()
    ran = [Candidate(b, n, k) for b in (1, 2, 4) for n in (1, 4) for k in (1, 2)]
    for i, x in enumerate(ran):
        st.add(measured(st, x, st.prior(x).device + extra(x), st.prior(x).host + extra(x), i + 1))
    assert st.fits["device"].well_posed and st.fits["device"].offset == "prior_device"
    c = Candidate(2, 2, 2)
    assert c not in ran and st.predict(c).device == pytest.approx(st.prior(c).device + extra(c), rel=1e-6)


def test_with_no_host_limit_configs_are_held_to_the_ceiling_trials_get():
    st = tiny_state()
    c = Candidate(4, 4, 2)
    assert st.predict(c).fits
    st.host_ceiling = int(st.prior(Candidate(1, 1, 1)).host * 1.05) + 1   # room for the smallest config only
    assert st.predict(c).over == ["host"] and st.predict(Candidate(1, 1, 1)).fits


def test_with_the_machine_s_rates_each_step_is_predicted_and_its_backend_s_trials_correct_it():
    """Given rates (sltune calibrate), every config of every backend has a step-time prior before any trial; a
    trial corrects its own backend's (one trial: by the ratio it measured; sltune.tuning.cost.correction). Each
    prediction carries it, as a trial's `predicted` stores it."""
    spec = parse({**KNOBS, "backend": ["speedloader", "fsdp"]})
    st = SearchState(spec, SHAPE, SearchSpace(spec, SHAPE), rates=rates_for(seq=32))
    probe, other, wrapped = Candidate(1, 1, 1), Candidate(2, 2, 1), fsdp(2, 2)
    before = {c: st.predict(c).prior_step for c in (probe, other, wrapped)}
    assert all(t is not None and t.seconds > 0 for t in before.values())
    step = 1.5 * before[probe].seconds
    st.add(FinishedTrial(0, probe, "probe", {"status": "ok", "step_seconds": step, "tokens_per_s": 32 / step}))
    after = st.predict(other).prior_step
    assert after.seconds == pytest.approx(1.5 * before[other].seconds)
    assert after.breakdown["compute"] == pytest.approx(1.5 * before[other].breakdown["compute"])
    assert st.predict(wrapped).prior_step == before[wrapped]            # FSDP's own trials correct FSDP's
    stored = st.predict(other).to_dict()
    assert stored["prior_step_seconds"] == pytest.approx(after.seconds)
    assert stored["prior_tokens_per_s"] == pytest.approx(2 * 2 * 32 / after.seconds)
    assert sum(stored["prior_breakdown"].values()) == pytest.approx(1.0)
    assert "prior_step_seconds" not in state().predict(other).to_dict()     # no rates: no step-time prior
