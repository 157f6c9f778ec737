"""What the search concludes from out-of-memory trials, and which limit binds."""

from sltune.tuning.shape import shape_of
from sltune.tuning.space import Candidate, SearchSpace
from sltune.tuning.spec import TuningSpec
from sltune.tuning.state import Done, SearchState


def state(**search):
    spec = TuningSpec.parse({"name": "s", "model": {"preset": "llama-tiny"}, "workload": {"seq_len": 32},
                             "search": {"sub_batch_size": [1, 2, 4], "num_sub_batches": [1, 2, 4],
                                        "num_live_blocks": [1, 2, 4], **search}})
    shape = shape_of("llama-tiny")
    return SearchState(spec, shape, SearchSpace(spec, shape))


def oom(c: Candidate, resource: str) -> Done:
    return Done(0, c, "probe", {"status": "oom", "oom_resource": resource, "error": "x"})


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
    from sltune.tuning.strategies import OneShotStrategy

    st = state(sub_batch_size=[3, 4, 5], num_sub_batches=None, effective_batch_size=[5, 12])
    probes = OneShotStrategy(st, 0).probes()
    assert probes and all(p in st.space.candidates for p in probes)


def ok(number: int, c: Candidate, tokens_per_s: float, ci: tuple[float, float]) -> Done:
    return Done(number, c, "grid", {"status": "ok", "tokens_per_s": tokens_per_s, "step_seconds": 1.0,
                                    "peak_device_bytes": 1, "peak_host_bytes": 1,
                                    "timing": {"steps_s": [1.0] * 5, "tokens_per_s_ci95": list(ci)}})


def test_the_runner_up_is_a_finalist_even_when_no_interval_overlaps_the_best():
    """Two trials run at different moments cannot be compared by their own intervals: the runner-up is
    re-measured beside the best whatever the intervals say; overlapping rivals join it."""
    from sltune.tuning import confirm

    st = state()
    a, b, c = Candidate(4, 4, 1), Candidate(2, 4, 1), Candidate(1, 4, 1)
    for i, (cand, tps, ci) in enumerate([(a, 1000.0, (990, 1010)), (b, 800.0, (790, 810)), (c, 500.0, (490, 510))]):
        st.add(ok(i, cand, tps, ci))
    assert confirm.finalists(st) == [a, b]
    assert confirm.plan(st, 2) == [a, b, a, b]
    st.add(ok(3, Candidate(4, 2, 1), 700.0, (600, 995)))        # overlaps the best: it is the rival now
    assert confirm.finalists(st) == [a, Candidate(4, 2, 1)]
