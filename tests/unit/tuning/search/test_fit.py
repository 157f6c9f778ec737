"""The least-squares models (sltune.tuning.search.fit): exact on linear data, honest about error and extrapolation;
the variables a config is fitted on."""

from __future__ import annotations

import pytest

from sltune.tuning.cost.setup import Setup
from sltune.tuning.cost.shape import shape_of
from sltune.tuning.search.fit import LinearFit, MODELS, variables
from sltune.tuning.search.state import SearchState
from sltune.tuning.search.trials import trial_spec
from sltune.tuning.space import Candidate, SearchSpace
from tests.support.offload_specs import BOTH, HOST, OPTIMIZER, WEIGHTS, spec


def rows(fn, points):
    return [({"k": k, "b": b, "s": 32, "B": b * n, "N": n, "G": 4 // k}, fn(k, b, n)) for k, b, n in points]


POINTS = [(k, b, n) for k in (1, 2, 4) for b in (1, 2, 4) for n in (1, 3)]


def test_recovers_exact_linear_coefficients():
    fit = LinearFit.fit("y", ["1", "k", "b*s", "k*b*s", "B*s"],
                        rows(lambda k, b, n: 1e6 + 2e5 * k + 300 * b * 32 + 50 * k * b * 32 + 7 * b * n * 32, POINTS))
    assert fit.well_posed and fit.r2 == pytest.approx(1.0)
    assert fit.coef == pytest.approx([1e6, 2e5, 300, 50, 7], rel=1e-6)
    assert fit.loo_rel_error < 1e-9
    assert fit.predict({"k": 3, "b": 3, "s": 32, "B": 9, "N": 3, "G": 2}) == pytest.approx(
        1e6 + 6e5 + 300 * 96 + 50 * 3 * 96 + 7 * 9 * 32)


def test_reports_error_on_noisy_data_and_flags_extrapolation():
    noisy = rows(lambda k, b, n: (100 + 10 * k + b) * (1.05 if (k + b + n) % 2 else 0.95), POINTS)
    fit = LinearFit.fit("y", ["1", "k", "b*s"], noisy)
    assert 0.5 < fit.r2 < 1.0
    assert fit.loo_rel_error > 0.02
    assert fit.extrapolated({"k": 8, "b": 2, "s": 32}) == ["k"]
    assert fit.extrapolated({"k": 2, "b": 2, "s": 32}) == []


def test_underdetermined_fit_predicts_nothing():
    fit = LinearFit.fit("y", ["1", "k", "b*s"], rows(lambda k, b, n: 5.0, [(1, 1, 1), (2, 1, 1)]))
    assert not fit.well_posed and fit.predict({"k": 1, "b": 1, "s": 32}) is None


def test_round_trips_through_a_dict():
    fit = LinearFit.fit("y", ["1", "k"], rows(lambda k, b, n: 3 + k, POINTS))
    again = LinearFit.from_dict(fit.to_dict())
    assert again.predict({"k": 7}) == pytest.approx(10)


def test_one_outlier_moves_a_robust_fit_by_less_than_its_noise():
    """A trial slowed 2.5x by another process, wherever it falls: the precision-weighted robust fit's
    predictions move by less than the 2% noise of a point; least squares on the same points moves more."""
    import numpy as np

    rng = np.random.default_rng(0)
    feats = ["1", "G", "N", "N*b*s"]
    step = lambda k, b, n: 0.01 + 0.004 * (4 // k) + 0.002 * n + 2e-5 * n * b * 32  # noqa: E731
    noise = 0.02
    points = [(1, 1, 1), (4, 1, 1), (1, 4, 1), (4, 4, 1), (1, 1, 4), (4, 1, 4), (2, 2, 2), (1, 4, 4), (4, 4, 4),
              (2, 4, 2), (2, 1, 4), (4, 2, 2)]
    clean = [(v, y * rng.lognormal(0, noise)) for v, y in rows(step, points)]
    sigma = [noise] * len(points)
    probes = [{"k": k, "b": b, "s": 32, "B": b * n, "N": n, "G": 4 // k} for k, b, n in
              [(2, 3, 3), (4, 2, 4), (1, 2, 2), (1, 1, 1), (2, 4, 4)]]
    robust_clean = LinearFit.fit("step_seconds", feats, clean, rel_sigma=sigma)
    plain_clean = LinearFit.fit("step_seconds", feats, clean)
    moved, moved_plain = [], []
    for i in range(len(points)):
        spoiled = list(clean)
        spoiled[i] = (spoiled[i][0], spoiled[i][1] * 2.5)
        robust = LinearFit.fit("step_seconds", feats, spoiled, rel_sigma=sigma)
        plain = LinearFit.fit("step_seconds", feats, spoiled)
        assert robust.robust and not plain.robust
        moved.append(max(abs(robust.predict(v) / robust_clean.predict(v) - 1) for v in probes))
        moved_plain.append(max(abs(plain.predict(v) / plain_clean.predict(v) - 1) for v in probes))
        assert robust.loo_typical_error < 2 * noise < robust.loo_rel_error   # the outlier's own miss is the max
    assert max(moved) < noise, moved
    assert min(moved_plain) > noise, moved_plain     # the test would catch a non-robust fit


def test_a_fit_with_too_few_points_says_how_many_more_trials_it_needs():
    """A DeepSpeed or FSDP fit of one point said only 'too few points': it says how many more trials make it predict,
    and how many more give it a leave-one-out error."""
    from sltune.tuning.search.fit import no_loo_reason

    one = {"n": 1, "features": ["1", "N", "N*b*s", "zero3"], "loo_rel_error": None}
    assert no_loo_reason(one) == ("too few points for a leave-one-out fit: 1 point for 4 coefficients: it predicts "
                                  "after 3 more trials that differ in its knobs, and has a leave-one-out error after "
                                  "4 more (5 in all)")
    assert no_loo_reason({**one, "n": 0}).endswith("it predicts after 4 more trials that differ in its knobs, and "
                                                   "has a leave-one-out error after 5 more (5 in all)")
    assert no_loo_reason({**one, "n": 4}).endswith("4 points for 4 coefficients: has a leave-one-out error after 1 "
                                                   "more (5 in all)")


def test_a_trials_recipe_and_the_fits_know_the_weights_are_on_disk(tmp_path):
    s = spec(BOTH)
    shape = shape_of("llama-tiny", "bfloat16")
    trial = trial_spec(s, WEIGHTS, None, offload_dir=tmp_path)
    assert Setup.of_trial(trial, shape).weights_on_disk(HOST)       # a profile's prior: the trial's own place
    v = variables(WEIGHTS, shape, 32)
    assert (v["disk"], v["wdisk"]) == (1.0, 1.0) and variables(OPTIMIZER, shape, 32)["wdisk"] == 0.0
    assert "[wdisk]" in MODELS["train"]["throughput"][1] and "[wdisk]" in MODELS["train"]["host"][1]
    st = SearchState(s, shape, SearchSpace(s, shape))
    assert "[wdisk]" in st.features["throughput"] and "[wdisk]" in st.features["host"]
    plain = SearchState(spec(), shape, SearchSpace(spec(), shape))
    assert "[wdisk]" not in plain.features["throughput"]      # constant over a space without it: dropped


def test_fit_variable_w_is_the_share_of_the_parameter_bytes_kept_in_whole_units():
    shape = shape_of("llama-tiny")         # 4 layers, untied: embedding, head and 4 layers are every parameter

    def w_of(k: int, share: float | None) -> float:
        return variables(Candidate(1, 1, k, kv_cache="host", weights_on_device=share), shape, 24)["W"]

    assert shape.embed_bytes + shape.head_bytes + shape.layers * shape.layer_bytes == shape.param_bytes
    assert (w_of(1, 1.0), w_of(4, 1.0), w_of(1, 0.0), w_of(1, None)) == (1.0, 1.0, 0.0, 0.0)
    # half: the embedding, the head and one layer; a second layer would pass half
    one_layer = shape.embed_bytes + shape.head_bytes + shape.layer_bytes
    assert w_of(1, 0.5) == one_layer / shape.param_bytes < 0.5 < (one_layer + shape.layer_bytes) / shape.param_bytes
    assert w_of(1, 0.5) * shape.param_bytes == shape.kept_bytes(1, 0.5)
    # groups of two layers: none fits beside the embedding and head, so half keeps only those two
    assert w_of(2, 0.5) == (shape.embed_bytes + shape.head_bytes) / shape.param_bytes
    assert "W" in MODELS["generate"]["device"][1] and "W/N" in MODELS["generate"]["throughput"][1]
    assert "W" not in MODELS["train"]["device"][1]
