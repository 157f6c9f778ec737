"""The prior: a config's host and device peaks predicted from the model's shape before any trial; the fits
correct it from there; `plan SPEC.yaml` and the refusals speak from it."""

import pytest

from sltune.cli.main import main
from sltune.tuning.cost.prior import predict
from sltune.tuning.cost.setup import Setup
from sltune.tuning.cost.shape import shape_of
from sltune.tuning.space import Candidate, SearchSpace
from sltune.tuning.search.state import FinishedTrial, SearchState
from tests.support.specs import admitted_spec


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
        return 5e4 + 3e3 * x.b * 32 + 2e3 * x.k

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


def test_a_host_limit_holds_every_rank_together_and_more_ranks_do_not_make_room():
    one = admitted_spec({"name": "w", "model": {"preset": "llama-small"}})
    two = admitted_spec({"name": "w", "model": {"preset": "llama-small"}, "hardware": {"world_size": 2}})
    shape = shape_of("llama-small")
    c = Candidate(1, 1, 1)
    p1, p2 = (predict(Setup.of_spec(s, shape), c) for s in (one, two))
    terms1, terms2 = dict(p1.host_terms), dict(p2.host_terms)
    # the parameters' terms are sharded: all ranks together hold them once; each rank runs its own batch
    assert terms2["AdamW's two moments in float32"] >= terms1["AdamW's two moments in float32"]
    assert p2.host > p1.host
    with pytest.raises(ValueError, match="all ranks together") as refused:
        admitted_spec({"name": "w", "model": {"preset": "llama-small"},
                       "hardware": {"world_size": 2, "host_memory_limit": p1.host // 2}})
    assert "world_size" not in str(refused.value).split("What would fit")[1]


def test_plan_reads_a_spec_before_any_trial_and_refuses_one_nothing_of_which_fits(tmp_path, capsys):
    small = tmp_path / "small.yaml"
    small.write_text("name: s\nmodel: {preset: llama-tiny}\nworkload: {seq_len: 32}\n"
                     "hardware: {device_memory_limit: 2MiB, host_memory_limit: 8GiB}\n"
                     "search: {sub_batch_size: [1, 4, 16], num_sub_batches: [1, 4], num_live_blocks: [1, 4]}\n")
    assert main(["plan", str(small)]) == 0
    out = capsys.readouterr().out
    assert "of 12 configs predicted to fit" in out and "no trial ran" in out
    assert "over device" in out and "  fits" in out and "binding limit: device" in out
    big = tmp_path / "big.yaml"
    big.write_text("name: b\nmodel: {preset: llama-2-7b, dtype: bfloat16}\nworkload: {seq_len: 128}\n"
                   "hardware: {host_memory_limit: 17GiB}\n")
    assert main(["plan", str(big)]) == 1
    out = capsys.readouterr().out
    assert "0 of 75 configs predicted to fit" in out
    refusal = next(line for line in out.splitlines() if line.startswith("  refused: "))
    assert "hardware.host_memory_limit 17.0 GiB is below the 11" in refusal
    assert "the weights in bfloat16 12.6, a float32 master copy 25.1, float32 gradients 25.1, AdamW's two " \
           "moments in float32 50.2, device buffers" in refusal and "What would fit: " in refusal
