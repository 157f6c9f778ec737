"""The configs a job may try (sltune.tuning.space): ranges expanded, kv_cache and weights_on_device swept in
generation only, the weights on disk beside the optimizer on disk, and the union of every backend's configs with
their Optuna parameters."""

from __future__ import annotations

import optuna
import pytest

from sltune.profiling.schema import TrialSpec
from sltune.tuning.cost.shape import shape_of
from sltune.tuning.space import Candidate, SearchSpace
from tests.support.backend_specs import KNOBS, ds, fsdp, space
from tests.support.offload_specs import BOTH, OPTIMIZER, WEIGHTS, spec
from tests.support.specs import parse


def test_kv_cache_is_swept_in_generation_only():
    shape = shape_of("llama-tiny")
    gen = {"workload": {"mode": "generate"}, "search": {"sub_batch_size": 2, "num_sub_batches": 2,
                                                        "num_live_blocks": 1, "weights_on_device": 0}}
    host, device = (Candidate(2, 2, 1, kv_cache=kv, weights_on_device=0.0) for kv in ("host", "device"))
    both = SearchSpace(parse(**gen), shape)
    assert both.candidates == [device, host]
    assert both.neighbours_up(host) == [device]
    assert Candidate(2, 2, 1, kv_cache="device").dominates(Candidate(2, 2, 1, kv_cache="host"))
    one = SearchSpace(parse(workload=gen["workload"], search={**gen["search"], "kv_cache": "device"}), shape)
    assert one.candidates == [device] and one.describe()["kv_cache"] == ["device"]
    train = SearchSpace(parse(search={**gen["search"], "weights_on_device": None}), shape)
    assert train.candidates == [Candidate(2, 2, 1)] and "kv_cache" not in train.distributions()


def test_weights_on_device_is_swept_in_generation_only_none_half_and_all_by_default():
    shape = shape_of("llama-tiny")
    gen = {"workload": {"mode": "generate"}, "search": {"sub_batch_size": 2, "num_sub_batches": 2,
                                                        "num_live_blocks": 1, "kv_cache": "host"}}
    space = SearchSpace(parse(**gen), shape)
    assert space.candidates == [Candidate(2, 2, 1, kv_cache="host", weights_on_device=w) for w in (0.0, 0.5, 1.0)]
    assert space.describe()["weights_on_device"] == [0.0, 0.5, 1.0]
    half = Candidate(2, 2, 1, kv_cache="host", weights_on_device=0.5)
    assert str(half) == "b=2 N=2 k=1 kv_cache=host w=0.5" and half.knobs()["weights_on_device"] == 0.5
    assert Candidate.from_knobs(half.knobs()) == half == space.candidate(space.params(half))    # Optuna's params
    assert space.neighbours_up(half) == [Candidate(2, 2, 1, kv_cache="host", weights_on_device=1.0)]
    assert space.distributions()["weights_on_device"].choices == (0.0, 0.5, 1.0)
    # keeping more weights needs at least as much device memory; a config without the knob keeps none
    assert Candidate(2, 2, 1, weights_on_device=1.0).dominates(Candidate(2, 2, 1, weights_on_device=0.5))
    assert not Candidate(2, 2, 1, weights_on_device=0.5).dominates(Candidate(2, 2, 1, weights_on_device=1.0))
    assert Candidate(2, 2, 1, weights_on_device=0.5).dominates(Candidate(2, 2, 1)) and \
        not Candidate(2, 2, 1).dominates(half)
    listed = parse(workload=gen["workload"], search={**gen["search"], "weights_on_device": [1, 0.5, 1, 0.5]})
    assert listed.search.weights_on_device == [0.5, 1.0]            # without repeats, in numeric order
    assert parse(workload=gen["workload"], search={**gen["search"], "weights_on_device": 0.25}
                 ).search.weights_on_device_values("generate") == [0.25]
    train = SearchSpace(parse(search={k: v for k, v in gen["search"].items() if k != "kv_cache"}), shape)
    assert train.candidates == [Candidate(2, 2, 1)] and "weights_on_device" not in train.distributions()


def test_space_expands_ranges_and_derives_n_from_a_fixed_effective_batch():
    spec = parse(search={"sub_batch_size": {"min": 1, "max": 12}, "effective_batch_size": 12,
                         "num_live_blocks": {"min": 1, "max": 8}})
    space = SearchSpace(spec, shape_of("llama-tiny"))
    assert space.b_values == [1, 2, 4, 8, 12]
    assert space.k_values == [1, 2, 4]                 # llama-tiny has 4 layers: k=8 is k=4
    assert {c.batch for c in space.candidates} == {12}
    assert Candidate(12, 1, 4) in space.candidates and Candidate(4, 3, 2) in space.candidates
    assert all(c.sub_batch_size != 8 for c in space.candidates)     # 8 does not divide 12
    assert space.candidate({"sub_batch_size": 8, "effective_batch_size": 12, "num_live_blocks": 1}) is None


# -- over backends ---------------------------------------------------------------------------------------------------
def test_the_space_is_the_union_of_each_backend_s_and_a_candidate_carries_its_backend_and_knobs():
    sp = space(backend=["speedloader", "deepspeed", "fsdp"], **KNOBS)
    by = {b: sp.of_backend(b) for b in sp.backends}
    assert len(by["speedloader"]) == 2 * 2 * 2 and len(by["deepspeed"]) == 4 * 6 and len(by["fsdp"]) == 4 * 2
    assert len(sp.candidates) == 8 + 24 + 8 and sorted(sp.candidates) == sp.candidates
    assert ds(1, 1, 2, "none", "cpu") not in sp          # offload_param at ZeRO-2: no candidate
    c = ds(2, 2, 3, "cpu", "cpu")
    assert c in sp and c.num_live_blocks is None
    assert str(c) == "deepspeed b=2 N=2 zero_stage=3 offload_optimizer=cpu offload_param=cpu"
    assert c.knobs() == {"sub_batch_size": 2, "num_sub_batches": 2, "num_live_blocks": None, "activations": "recompute",
                         "backend": "deepspeed", "zero_stage": 3, "offload_optimizer": "cpu", "offload_param": "cpu"}
    assert Candidate(2, 2, 1).knobs() == {"sub_batch_size": 2, "num_sub_batches": 2, "num_live_blocks": 1,
                                          "activations": "recompute"}      # as before there were backends
    # a stored trial's config of any backend reads back (TrialResult.config: num_live_blocks None, its own knobs)
    for cand in (c, fsdp(1, 2, cpu=True), Candidate(1, 2, 2)):
        ran = TrialSpec(backend=cand.backend, sub_batch_size=cand.sub_batch_size, num_sub_batches=cand.num_sub_batches,
                        num_live_blocks=cand.num_live_blocks or 1, **cand.backend_knobs()).knobs()
        assert Candidate.from_knobs(ran) == cand == Candidate.from_knobs(cand.knobs())
    # another backend's configs never dominate (their knobs trade memory for speed): each keeps its frontier
    assert fsdp(2, 2).dominates(fsdp(1, 2)) and not fsdp(2, 2).dominates(fsdp(1, 2, cpu=True))
    assert not Candidate(2, 2, 1).dominates(ds(1, 1)) and not ds(2, 2).dominates(Candidate(1, 1, 1))


def test_optuna_sees_the_backend_first_and_then_only_that_backend_s_swept_knobs():
    sp = space(backend=["speedloader", "deepspeed", "fsdp"], **KNOBS)
    assert list(sp.distributions()) == ["backend", "sub_batch_size", "num_sub_batches", "num_live_blocks",
                                        "zero_stage", "offload_optimizer", "offload_param", "cpu_offload"]
    assert sp.distributions()["backend"].choices == ("speedloader", "deepspeed", "fsdp")
    # reshard_after_forward has one value: no parameter; num_live_blocks is SpeedLoader's alone
    assert sp.params(fsdp(2, 1, cpu=True)) == {"backend": "fsdp", "sub_batch_size": 2, "num_sub_batches": 1,
                                               "cpu_offload": True}
    assert sp.params(Candidate(2, 1, 2)) == {"backend": "speedloader", "sub_batch_size": 2, "num_sub_batches": 1,
                                             "num_live_blocks": 2}
    for c in sp.candidates:
        assert sp.candidate(sp.params(c)) == c
    assert sp.candidate({**sp.params(ds(1, 1)), "offload_param": "cpu"}) is None     # ZeRO-2: pruned unrun
    one = space(backend="deepspeed", deepspeed={"zero_stage": [2, 3], "offload_optimizer": "cpu"})
    assert one.param_names == ("sub_batch_size", "num_sub_batches", "zero_stage", "offload_param")
    assert one.describe()["backend"] == ["deepspeed"] and "num_live_blocks" not in one.describe()


def test_every_sampler_searches_the_union_define_by_run():
    sp = space(backend=["speedloader", "deepspeed", "fsdp"], **KNOBS)
    for sampler in (optuna.samplers.RandomSampler(seed=0), optuna.samplers.TPESampler(seed=0, n_startup_trials=5)):
        study = optuna.create_study(direction="maximize", sampler=sampler)
        seen = set()
        for i in range(60):
            trial = study.ask()
            c = sp.suggest(trial)
            if c is None:
                study.tell(trial, state=optuna.trial.TrialState.PRUNED)
                continue
            assert c in sp and set(trial.params) == set(sp.params(c))
            seen.add(c.backend)
            study.tell(trial, float(c.batch + i))
        assert seen == {"speedloader", "deepspeed", "fsdp"}
    # the grid strategy enqueues each candidate: a trial of exactly its parameters
    study = optuna.create_study(sampler=optuna.samplers.GridSampler(sp.grid()))
    for c in sp.candidates[:10]:
        study.enqueue_trial(sp.params(c))
        assert sp.suggest(study.ask()) == c


@pytest.mark.parametrize("search", [{}, {"activations": ["recompute", "offload"],
                                         "optimizer_offload": ["host", "disk"]},
                                    {"effective_batch_size": [4, 8], "num_sub_batches": None}])
def test_a_speedloader_only_spec_s_optuna_parameters_are_unchanged(search):
    """A stored study resumes: the same parameters, distributions and draws as study.ask(distributions()) gave."""
    sp = space(**{"sub_batch_size": [1, 2, 4], "num_sub_batches": [1, 2], "num_live_blocks": [1, 2], **search})
    second = "effective_batch_size" if "effective_batch_size" in search else "num_sub_batches"
    names = ["sub_batch_size", second, "num_live_blocks"] + [k for k in ("activations", "optimizer_offload")
                                                            if k in search]
    assert list(sp.distributions()) == names and sp.param_names == tuple(names)
    assert "backend" not in sp.params(sp.candidates[0])
    old = optuna.create_study(sampler=optuna.samplers.TPESampler(seed=3, n_startup_trials=3))
    new = optuna.create_study(sampler=optuna.samplers.TPESampler(seed=3, n_startup_trials=3))
    for i in range(12):
        a, b = old.ask(sp.distributions()), new.ask()
        c = sp.suggest(b)
        assert a.params == b.params and a.distributions == b.distributions
        assert c == sp.candidate(a.params)
        old.tell(a, float(i % 5))
        new.tell(b, float(i % 5))


# -- the weights on disk (search.param_offload) -------------------------------------------------------------------
def test_search_param_offload_is_swept_like_optimizer_offload():
    s = spec(BOTH)
    assert s.search.param_offload == ["host", "disk"]
    assert spec({**BOTH, "param_offload": ["disk", "host", "disk"]}).search.param_offload == ["host", "disk"]
    assert spec({**BOTH, "param_offload": "disk"}).search.param_offload == ["disk"]
    assert spec().search.param_offload == ["host"]
    space = SearchSpace(s, shape_of("llama-tiny", "bfloat16"))
    places = {(c.optimizer_offload, c.param_offload) for c in space.candidates}
    # the weights on disk train only beside the optimizer on disk (the runtime refuses the other pairing)
    assert places == {("host", "host"), ("disk", "host"), ("disk", "disk")}
    assert space.distributions()["param_offload"].choices == ("host", "disk")
    assert space.describe()["param_offload"] == ["host", "disk"]
    assert "param_offload" not in SearchSpace(spec(), shape_of("llama-tiny", "bfloat16")).distributions()
    # a combination Optuna may suggest that is no candidate is pruned without running
    params = {"sub_batch_size": 1, "num_sub_batches": 1, "num_live_blocks": 1}
    assert space.candidate({**params, "optimizer_offload": "host", "param_offload": "disk"}) is None
    assert space.candidate({**params, "optimizer_offload": "disk", "param_offload": "disk"}) == WEIGHTS
    # one step up brings the weights back into host memory (the optimizer's step up is no candidate)
    assert space.neighbours_up(WEIGHTS) == [Candidate(2, 1, 1, optimizer_offload="disk", param_offload="disk"),
                                            Candidate(1, 2, 1, optimizer_offload="disk", param_offload="disk"),
                                            OPTIMIZER]
    assert s.digest() != spec({"optimizer_offload": ["host", "disk"]}).digest()


def test_generation_sweeps_the_weights_on_disk_alone():
    s = spec({"param_offload": ["host", "disk"], "num_sub_batches": [1]}, workload={"mode": "generate"})
    space = SearchSpace(s, shape_of("llama-tiny", "bfloat16"))
    assert {c.param_offload for c in space.candidates} == {"host", "disk"}
    assert {c.optimizer_offload for c in space.candidates} == {"host"}
    spec({"param_offload": "disk"}, workload={"mode": "generate"}, hardware={"disk_limit": "1GiB"})  # disk is tried
