"""What the search concludes from out-of-memory trials, and which limit binds."""

from sltune.tuning.cost.shape import shape_of
from sltune.tuning.space import Candidate, SearchSpace
from sltune.tuning.search.state import FinishedTrial, SearchState
from tests.support.specs import admitted_spec


def state(**search):
    spec = admitted_spec({"name": "s", "model": {"preset": "llama-tiny"}, "workload": {"seq_len": 32},
                          "search": {"sub_batch_size": [1, 2, 4], "num_sub_batches": [1, 2, 4],
                                     "num_live_blocks": [1, 2, 4], **search}})
    shape = shape_of("llama-tiny")
    return SearchState(spec, shape, SearchSpace(spec, shape))


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


def test_probes_come_from_real_candidates_in_awkward_spaces():
    from sltune.tuning.search.strategies import OneShotStrategy

    st = state(sub_batch_size=[3, 4, 5], num_sub_batches=None, effective_batch_size=[5, 12])
    probes = OneShotStrategy(st, 0).probes()
    assert probes and all(p in st.space.candidates for p in probes)


def ok(number: int, c: Candidate, tokens_per_s: float, ci: tuple[float, float]) -> FinishedTrial:
    return FinishedTrial(number, c, "grid", {"status": "ok", "tokens_per_s": tokens_per_s, "step_seconds": 1.0,
                                    "peak_device_bytes": 1, "peak_host_bytes": 1,
                                    "timing": {"steps_s": [1.0] * 5, "tokens_per_s_ci95": list(ci)}})


def test_the_runner_up_is_a_finalist_even_when_no_interval_overlaps_the_best():
    """Two trials run at different moments cannot be compared by their own intervals: the runner-up is
    re-measured beside the best whatever the intervals say; overlapping rivals join it."""
    from sltune.tuning.search import confirm

    st = state()
    a, b, c = Candidate(4, 4, 1), Candidate(2, 4, 1), Candidate(1, 4, 1)
    for i, (cand, tps, ci) in enumerate([(a, 1000.0, (990, 1010)), (b, 800.0, (790, 810)), (c, 500.0, (490, 510))]):
        st.add(ok(i, cand, tps, ci))
    assert confirm.finalists(st) == [a, b]
    assert confirm.plan(st, 2) == [a, b, a, b]
    st.add(ok(3, Candidate(4, 2, 1), 700.0, (600, 995)))        # overlaps the best: it is the rival now
    assert confirm.finalists(st) == [a, Candidate(4, 2, 1)]


def test_oneshot_tries_the_fastest_config_when_only_the_safety_margin_rules_it_out():
    """The fastest config often peaks just under a limit (the grid's best in bench/noise.py (a): 1.8% under
    it). Predicted to fit only inside the 5% margin, it is still tried when it is the one predicted fastest;
    `fits` (what plan and export report) keeps the margin."""
    from sltune.tuning.search.strategies import OneShotStrategy

    s = 32
    def peak(c: Candidate) -> float:
        return 1e6 + 1e4 * c.b * s                          # device memory grows with b only

    def step(c: Candidate) -> float:
        return 0.05 + 0.01 * c.n + 1e-4 * c.n * c.b * s     # larger b and N: more tokens/s

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


def test_confirmation_rounds_end_early_only_when_the_search_best_won_decisively_and_cleanly():
    from sltune.tuning.search import confirm

    st = state()
    a, b = Candidate(4, 4, 1), Candidate(2, 4, 1)
    st.add(ok(0, a, 1000.0, (990, 1010)))
    st.add(ok(1, b, 700.0, (690, 710)))
    picks = confirm.finalists(st)
    assert picks == [a, b] and not confirm.settled(st, picks)

    def round_(tps_a: float, tps_b: float, unstable: bool = False) -> None:
        for cand, tps in ((a, tps_a), (b, tps_b)):
            d = ok(len(st.confirms) + 2, cand, tps, (tps * 0.99, tps * 1.01))
            d.result["timing"].update(steps_s=[cand.batch * 32 / tps * (1 + 0.01 * i) for i in range(5)],
                                      tokens_per_step=cand.batch * 32)
            d.result["timing"]["unstable"] = unstable
            st.confirms.append(d)
            if cand == a:
                assert not confirm.settled(st, picks)           # never in the middle of a round

    round_(1000.0, 950.0)
    assert not confirm.settled(st, picks)                       # 1.05x: not decisive
    st.confirms.clear()
    round_(1000.0, 600.0, unstable=True)
    assert not confirm.settled(st, picks)                       # decisive, but measured under interference
    st.confirms.clear()
    round_(1000.0, 600.0)
    assert confirm.settled(st, picks)                           # 1.67x, clean: settled after one round
    st.confirms.clear()
    round_(600.0, 1000.0)
    assert not confirm.settled(st, picks)                       # the runner-up won: keep measuring


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


def test_a_gap_measured_under_interference_must_show_in_two_rounds():
    """One round that measured a rival 1.67x slower drops it only if neither trial ran under interference;
    a second round with the same gap drops it either way."""
    from sltune.tuning.search import confirm

    st = state()
    a, b = Candidate(4, 4, 1), Candidate(2, 4, 1)
    st.add(ok(0, a, 1000.0, (990, 1010)))
    st.add(ok(1, b, 700.0, (690, 710)))
    picks = confirm.finalists(st)

    def round_(tps_a: float, tps_b: float, unstable: bool) -> None:
        for cand, tps in ((a, tps_a), (b, tps_b)):
            d = ok(len(st.confirms) + 2, cand, tps, (tps * 0.99, tps * 1.01))
            d.result["timing"].update(steps_s=[cand.batch * 32 / tps * (1 + 0.01 * i) for i in range(5)],
                                      tokens_per_step=cand.batch * 32, unstable=unstable)
            st.confirms.append(d)

    round_(1000.0, 600.0, unstable=True)
    assert confirm.remaining(st, picks, 3) == [a, b, a, b]
    round_(1000.0, 600.0, unstable=True)
    assert confirm.settled(st, picks) and confirm.remaining(st, picks, 3) == []
    assert confirm.verdict(st, picks)["rounds"] == 2
