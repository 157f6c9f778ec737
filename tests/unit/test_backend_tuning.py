"""Tuning over backends (issue #33): the spec's search.backend and its sections, the union space and its Optuna
parameters, each backend's prior and fits, refusals naming the backend, and a diverged trial never picked."""

import dataclasses
import importlib.util
import re

import optuna
import pytest
import yaml

from sltune.profiling.schema import TrialSpec
from tests.support.specs import admitted_spec as admitted
from sltune.tuning.cost.prior import predict
from sltune.tuning.cost.setup import Setup
from sltune.tuning.cost.shape import shape_of
from sltune.tuning.report.plan_from_prior import plan_spec
from sltune.tuning.report.result import job_result
from sltune.tuning.search.confirm import ranked, winner_of
from sltune.tuning.search.state import FinishedTrial, SearchState
from sltune.tuning.search.strategies import OneShotStrategy
from sltune.tuning.search.trials import trial_spec
from sltune.tuning.space import Candidate, SearchSpace
from sltune.tuning.spec import TuningSpec
from tests.support.cli import sltune
from tests.support.deepspeed import needs_deepspeed

SHAPE = shape_of("llama-tiny")
KNOBS = {"sub_batch_size": [1, 2], "num_sub_batches": [1, 2], "num_live_blocks": [1, 2]}


def parse(search: dict | None = None, **sections) -> TuningSpec:
    return TuningSpec.parse({"model": {"preset": "llama-tiny"}, "workload": {"seq_len": 32}, **sections,
                             "search": search or {}})


def space(**search) -> SearchSpace:
    return SearchSpace(parse(search), SHAPE)


def ds(b: int, n: int, stage: int = 2, opt: str = "none", param: str = "none") -> Candidate:
    return Candidate(b, n, None, backend="deepspeed", zero_stage=stage, offload_optimizer=opt, offload_param=param)


def fsdp(b: int, n: int, cpu: bool = False) -> Candidate:
    return Candidate(b, n, None, backend="fsdp", cpu_offload=cpu, reshard_after_forward=True)


# -- the spec --------------------------------------------------------------------------------------------------------
def test_a_spec_without_backends_is_speedloader_alone_and_the_same_job_as_before():
    plain = parse()
    assert plain.search.backend == ["speedloader"] and plain.search.deepspeed is None and plain.search.fsdp is None
    assert "backend" not in plain.model_dump(mode="json", exclude_defaults=True).get("search", {})
    assert parse({"backend": "speedloader"}).digest() == plain.digest()      # written out: the same job
    assert parse({"backend": ["fsdp", "speedloader", "fsdp"]}).search.backend == ["speedloader", "fsdp"]


def test_each_backend_section_defaults_to_the_issue_s_values_and_drops_combinations_that_do_not_run():
    s = parse({"backend": ["speedloader", "deepspeed", "fsdp"]}).search
    assert s.backend_values("deepspeed") == {"zero_stage": [2, 3], "offload_optimizer": ["none", "cpu"],
                                             "offload_param": ["none", "cpu"]}
    assert s.backend_values("fsdp") == {"cpu_offload": [False, True], "reshard_after_forward": [True]}
    variants = s.backend_variants("deepspeed")
    assert len(variants) == 6 and {"zero_stage": 2, "offload_optimizer": "none", "offload_param": "cpu"} not in variants
    assert all(v["offload_param"] == "none" or v["zero_stage"] == 3 for v in variants)
    one = parse({"backend": "deepspeed", "deepspeed": {"zero_stage": 3, "offload_param": "cpu"}}).search
    assert one.backend_variants("deepspeed") == [{"zero_stage": 3, "offload_optimizer": o, "offload_param": "cpu"}
                                                 for o in ("none", "cpu")]


@pytest.mark.parametrize("spec, named", [
    ({"search": {"backend": "fsdp", "num_live_blocks": 2}},
     "search.num_live_blocks is SpeedLoader's, and search.backend [fsdp] does not include speedloader; add"),
    ({"search": {"backend": "deepspeed", "schedule": "canonical"}}, "search.schedule is SpeedLoader's"),
    ({"search": {"backend": ["speedloader", "fsdp"], "deepspeed": {"zero_stage": 3}}},
     "search.deepspeed sets the deepspeed backend's knobs, and search.backend [speedloader, fsdp] does not include "
     "deepspeed; add deepspeed to search.backend, or remove search.deepspeed"),
    ({"search": {"backend": "deepspeed", "deepspeed": {"zero_stage": 2, "offload_param": ["cpu"]}}},
     "search.deepspeed.offload_param: cpu and nvme offload ZeRO-3's parameter partitions, and "
     "search.deepspeed.zero_stage has no 3"),
    ({"search": {"backend": "deepspeed", "deepspeed": {"zero_stage": [2, 4]}}},
     "search.deepspeed.zero_stage: 4 is not one of 2, 3; give 2, 3 or a list such as [2, 3]"),
    ({"search": {"backend": "fsdp", "fsdp": {"cpu_offload": 1}}},
     "search.fsdp.cpu_offload: 1 is not one of false, true; give false, true or a list such as [false, true]"),
    ({"search": {"backend": "fsdp", "fsdp": {"reshard_after_forward": []}}},
     "search.fsdp.reshard_after_forward: give false, true or a list such as [false, true], not an empty list"),
    ({"search": {"backend": ["speedloader", "megatron"]}},
     "search.backend: 'megatron' is not a backend; choose from speedloader, deepspeed, fsdp"),
    ({"workload": {"mode": "generate"}, "search": {"backend": ["speedloader", "fsdp"]}},
     "search.backend: fsdp trains only; generation (workload.mode generate) is SpeedLoader's"),
    ({"search": {"backend": ["speedloader", "deepspeed"], "probe_layers": "auto"}},
     "search.probe_layers: probes at reduced depth are SpeedLoader's"),
    ({"model": {"preset": "llama-tiny", "dtype": "float16"}, "search": {"backend": ["speedloader", "fsdp"]}},
     "model.dtype: float16 needs loss scaling, which the fsdp backend does not run"),
    ({"model": {"preset": "llama-tiny", "dtype": "bfloat16", "mixed_precision": False},
      "search": {"backend": ["speedloader", "deepspeed"]}},
     "model.mixed_precision: backend deepspeed keeps float32 master weights under bfloat16; set it true, or drop"),
])
def test_what_a_backend_cannot_run_is_refused_naming_the_field_and_the_fix(spec, named):
    with pytest.raises(ValueError, match="^spec: " + re.escape(named)):
        TuningSpec.parse({"model": {"preset": "llama-tiny"}, **spec})


@needs_deepspeed
def test_nvme_without_libaio_is_refused_at_admission_and_a_trial_without_its_folder_when_it_is_built(monkeypatch):
    from sltune.backends import knobs

    nvme = {"name": "nvme", "model": {"preset": "llama-tiny"},
            "search": {"backend": "deepspeed", "deepspeed": {"zero_stage": 3, "offload_optimizer": ["none", "nvme"]}}}
    monkeypatch.setattr(knobs, "libaio_found", lambda: False)
    with pytest.raises(ValueError, match=r"^spec: search\.deepspeed\.offload_optimizer: nvme needs libaio for "
                                         r"DeepSpeed's async I/O \(apt-get install libaio-dev"):
        admitted(nvme)
    spec = TuningSpec.parse(nvme)         # parsing reads no machine: a stored job is read back anywhere
    c = ds(1, 1, stage=3, opt="nvme")
    assert c in SearchSpace(spec, SHAPE) and c.writes_files
    with pytest.raises(ValueError, match=r"search\.deepspeed\.offload_optimizer nvme needs the runner's offload "
                                         r"folder for its trial \(offload_dir\)"):
        trial_spec(spec, c, None)


def test_a_backend_that_is_not_installed_is_refused_at_admission(monkeypatch):
    from sltune.tuning.cost import admission

    real = importlib.util.find_spec
    monkeypatch.setattr(admission.importlib.util, "find_spec", lambda name: None if name == "deepspeed" else real(name))
    with pytest.raises(ValueError, match=r"search\.backend: deepspeed is not installed here; install it with `bash "
                                         r"scripts/install\.sh backends`, or drop deepspeed from search\.backend"):
        admitted({"name": "x", "model": {"preset": "llama-tiny"}, "search": {"backend": ["speedloader", "deepspeed"]}})


# -- the space -------------------------------------------------------------------------------------------------------
def test_the_space_is_the_union_of_each_backend_s_and_a_candidate_carries_its_backend_and_knobs():
    sp = space(backend=["speedloader", "deepspeed", "fsdp"], **KNOBS)
    by = {b: sp.of_backend(b) for b in sp.backends}
    assert len(by["speedloader"]) == 2 * 2 * 2 and len(by["deepspeed"]) == 4 * 6 and len(by["fsdp"]) == 4 * 2
    assert len(sp.candidates) == 8 + 24 + 8 and sorted(sp.candidates) == sp.candidates
    assert ds(1, 1, 2, "none", "cpu") not in sp          # offload_param at ZeRO-2: no candidate
    c = ds(2, 2, 3, "cpu", "cpu")
    assert c in sp and c.k is None
    assert str(c) == "deepspeed b=2 N=2 zero_stage=3 offload_optimizer=cpu offload_param=cpu"
    assert c.knobs() == {"sub_batch_size": 2, "num_sub_batches": 2, "num_live_blocks": None, "activations": "recompute",
                         "backend": "deepspeed", "zero_stage": 3, "offload_optimizer": "cpu", "offload_param": "cpu"}
    assert Candidate(2, 2, 1).knobs() == {"sub_batch_size": 2, "num_sub_batches": 2, "num_live_blocks": 1,
                                          "activations": "recompute"}      # as before there were backends
    # a stored trial's config of any backend reads back (TrialResult.config: num_live_blocks None, its own knobs)
    for cand in (c, fsdp(1, 2, cpu=True), Candidate(1, 2, 2)):
        ran = TrialSpec(backend=cand.backend, sub_batch_size=cand.b, num_sub_batches=cand.n,
                        num_live_blocks=cand.k or 1, **cand.backend_knobs()).knobs()
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


# -- the prior, admission and the fits --------------------------------------------------------------------------------


@pytest.mark.parametrize("stage, opt, param", [(2, "none", "none"), (2, "cpu", "none"), (3, "none", "none"),
                                               (3, "cpu", "none"), (3, "cpu", "cpu")])
def test_the_deepspeed_prior_holds_what_its_trials_allocate(stage, opt, param):
    """float16 with AdamW over 2 ranks: the terms bench/wrapped_anatomy.py found in DeepSpeed's trials. Held all step:
    the weights in dtype (a copy each at ZeRO-2, a 1/W shard at ZeRO-3) and, unless offloaded, the float32 master and
    Adam's state (12 bytes, 1/W); at the step the float32 gradient partitions, the dtype ones flattened for that copy
    and ZeRO-2's averaged dtype ones. With the optimizer offloaded, the backward's end holds the largest parameter's
    gradient whole in dtype and a float64 copy of its partition (the gradient norm DeepSpeed takes before offloading
    it)."""
    from sltune.tuning.cost.wrapped import model_states

    spec = parse({"backend": "deepspeed"}, model={"preset": "llama-tiny", "dtype": "float16"},
                 hardware={"world_size": 2})
    shape = shape_of("llama-tiny", "float16")
    recipe, c = Setup.of_spec(spec, shape), ds(1, 1, stage, opt, param)
    count, world = shape.param_bytes // 2, 2
    largest = max(shape.layer_numels + shape.embed_numels + shape.head_numels + shape.tied_numels)
    weights = 2 * count // world if stage == 3 else 2 * count
    device, host = model_states(recipe, c)
    got = dict(device)
    if opt == "cpu":
        assert got["the largest parameter's gradient"] == 2 * largest
        assert got["its partition in float64 for the gradient norm"] == 8 * -(-largest // world)
        assert sum(n for what, n in host if "offloaded" in what) == 16 * count + (2 * count if param == "cpu" else 0)
    else:
        assert got["float32 master partitions (ZeRO shards)"] == 4 * count // world
        assert got["float32 gradient partitions (ZeRO shards)"] == 4 * count // world
        assert ("float16 gradient partitions (ZeRO shards)" in got) == (stage == 2)
        assert got["float16 gradient partitions flattened for that copy"] == 2 * count // world
    assert got.get("the weights in float16 (ZeRO-3 shards)" if stage == 3 else
                   "the weights in float16 (every rank a copy)", 0) == (0 if param == "cpu" else weights)
    # the prior's device peak is one moment's: what is held, and the fullest of the backward, its end and the step
    prior = predict(recipe, c).device
    held = weights * (param != "cpu") + (12 * count // world if opt == "none" else 0)
    assert prior >= held + (2 * largest + 8 * -(-largest // world) if opt == "cpu" else 4 * count // world)


def test_the_fsdp_prior_is_its_shards_and_gathered_weights_from_the_shape():
    spec = parse({"backend": "fsdp"}, hardware={"world_size": 2})
    recipe = Setup.of_spec(spec, SHAPE)
    count = SHAPE.param_bytes // SHAPE.itemsize
    on_device = dict(predict(recipe, fsdp(1, 1)).device_terms)
    assert on_device["float32 weight shards"] == 4 * count // 2                   # 1/W each rank
    offloaded = predict(recipe, fsdp(1, 1, cpu=True))
    assert "float32 weight shards" not in dict(offloaded.device_terms)
    assert dict(offloaded.host_terms)["float32 weight shards (cpu_offload)"] == 4 * count    # every rank's
    # the step holds the most at b=1; from some b on, the backward's activations do, and grow with it
    one, four, many = (predict(recipe, fsdp(b, 1)).device for b in (1, 4, 64))
    assert one == four < many


def test_a_backend_that_cannot_fit_is_refused_before_any_trial_naming_it():
    base = {"name": "x", "model": {"preset": "llama-tiny"}, "workload": {"seq_len": 32},
            "search": {"backend": ["speedloader", "fsdp"], "fsdp": {"cpu_offload": False}, **KNOBS}}
    spec = TuningSpec.parse(base)
    recipe = Setup.of_spec(spec, SHAPE)
    least = {b: min(predict(recipe, c).device for c in SearchSpace(spec, SHAPE).of_backend(b))
             for b in ("speedloader", "fsdp")}
    assert least["speedloader"] < least["fsdp"]
    limit = (least["speedloader"] + least["fsdp"]) // 2
    with pytest.raises(ValueError, match=r"^spec: search\.backend fsdp: no fsdp config fits: "
                                         r"hardware\.device_memory_limit .* the smallest config of backend fsdp "
                                         r"\(fsdp b=1 N=1 cpu_offload=false reshard_after_forward=true\) is "
                                         r"predicted to need .*\(or drop fsdp from search\.backend\)"):
        admitted({**base, "hardware": {"device_memory_limit": limit}})
    admitted({**base, "hardware": {"device_memory_limit": limit}, "search": {**base["search"], "backend": "speedloader",
                                                                              "fsdp": None}})


@needs_deepspeed
def test_nvme_files_are_disk_held_to_the_disk_limit(monkeypatch):
    """DeepSpeed's nvme offload writes its partitions to files: the prior counts them as disk (its estimators'
    bytes: the float32 master, Adam's two moments and the float32 gradients, 16 per parameter, and ZeRO-3's weight
    shards in dtype), and a spec whose disk limit is below them is refused naming hardware.disk_limit."""
    from sltune.backends import knobs

    monkeypatch.setattr(knobs, "libaio_found", lambda: True)
    base = {"name": "nvme", "model": {"preset": "llama-tiny"}, "workload": {"seq_len": 32},
            "search": {"backend": "deepspeed", "sub_batch_size": [1], "num_sub_batches": [1],
                       "deepspeed": {"zero_stage": 3, "offload_optimizer": "nvme", "offload_param": "nvme"}}}
    recipe = Setup.of_spec(TuningSpec.parse(base), SHAPE)
    count = SHAPE.param_bytes // SHAPE.itemsize
    prior = predict(recipe, ds(1, 1, stage=3, opt="nvme", param="nvme"))
    assert prior.disk == (4 + 8 + 4 + SHAPE.itemsize) * count, prior.disk_terms
    assert predict(recipe, ds(1, 1, stage=3, opt="cpu", param="cpu")).disk == 0
    with pytest.raises(ValueError, match=r"hardware\.disk_limit 1\.0 MiB is below the .* the smallest config "
                                         r"\(deepspeed b=1 N=1 zero_stage=3 offload_optimizer=nvme "
                                         r"offload_param=nvme\) is predicted to need on disk: float32 master"):
        admitted({**base, "hardware": {"disk_limit": "1MiB"}})
    admitted({**base, "hardware": {"disk_limit": f"{prior.disk * 2}B"}})


def ok(number: int, c: Candidate, tps: float, status: str = "ok") -> FinishedTrial:
    return FinishedTrial(number, c, "grid", {
        "status": status, "tokens_per_s": tps, "step_seconds": c.batch * 32 / tps,
        "peak_device_bytes": 10**6 * c.b, "peak_host_bytes": 10**8 + c.b,
        **({"error": "step-1 loss 2 is not plain PyTorch's 1"} if status != "ok" else {}),
        "timing": {"steps_s": [c.batch * 32 / tps] * 5, "median_s": c.batch * 32 / tps,
                   "tokens_per_s_ci95": [0.99 * tps, 1.01 * tps]}})


def state_of(**search) -> SearchState:
    spec = parse({**KNOBS, **search})
    return SearchState(spec, SHAPE, SearchSpace(spec, SHAPE))


def test_each_backend_is_fitted_to_its_own_trials_under_its_own_names():
    alone = state_of()
    assert list(alone.models) == ["device", "host", "throughput"]       # a SpeedLoader job's, as before
    st = state_of(backend=["speedloader", "fsdp"])
    assert list(st.models) == ["device", "host", "throughput", "fsdp.device", "fsdp.host", "fsdp.throughput"]
    assert "[cpu_offload]" in st.features["fsdp.device"] and "k" not in st.features["fsdp.device"]
    for i, c in enumerate([fsdp(1, 1), fsdp(2, 1), fsdp(1, 2), fsdp(1, 1, cpu=True), fsdp(1, 2, cpu=True),
                           Candidate(1, 1, 1)]):
        st.add(ok(i, c, 1000.0 * c.batch / (1 + 0.1 * c.n)))
    assert st.fits["fsdp.throughput"].n == 5 and st.fits["throughput"].n == 1 and st.fits["fsdp.device"].n == 5
    assert st.predict(fsdp(2, 1, cpu=True)).tokens_per_s is not None     # fitted on fsdp's trials alone


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
    law = {"speedloader": lambda c: 100.0 * c.b * (1 + 0.2 * c.n) * (1 + 0.05 * c.k),
           "fsdp": lambda c: 130.0 * c.b * (1 + 0.2 * c.n) * (0.95 if c.cpu_offload else 1.0)}
    while (p := strategy.propose()).role == "probe":
        st.add(ok(len(st.history), p.candidate, law[p.candidate.backend](p.candidate)))
    # first each backend's top predicted config, once: its fit from the probes alone extrapolates there
    assert (p.candidate.backend, p.candidate.b, p.candidate.n, p.candidate.k) == ("speedloader", 2, 2, 2), p
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


# -- plan ------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backends", [
    ["speedloader", "fsdp"], ["fsdp"],
    pytest.param(["speedloader", "deepspeed", "fsdp"], marks=needs_deepspeed),
    pytest.param(["deepspeed"], marks=needs_deepspeed)])
def test_plan_predicts_ranks_and_refuses_a_spec_of_every_backend(backends, tmp_path):
    """`sltune plan` on a spec naming DeepSpeed or FSDP (it crashed sorting their missing k): every config of every
    backend predicted, the largest of each that fits listed, and a limit none fits refused naming the backend."""
    knobs = {"sub_batch_size": [1, 2], "num_sub_batches": [1, 2],
             **({"num_live_blocks": [1, 2]} if "speedloader" in backends else {})}
    spec = {"name": "plan", "model": {"preset": "llama-tiny"}, "workload": {"seq_len": 32},
            "hardware": {"device_memory_limit": "64MiB"}, "search": {"backend": backends, **knobs}}
    out = plan_spec(spec, "spec.yaml")
    assert out["fitting"] == out["candidates"] == len(out["configs"]) and out["refusal"] is None
    assert {c["config"].get("backend", "speedloader") for c in out["configs"]} == set(backends)
    largest = [x["config"] for x in out["largest"]]
    assert {c.get("backend", "speedloader") for c in largest} == set(backends)
    assert all(c["sub_batch_size"] == 2 and c["num_sub_batches"] == 2 for c in largest)
    refused = plan_spec({**spec, "hardware": {"device_memory_limit": "1KiB"}}, "spec.yaml")
    assert refused["fitting"] == 0 and refused["largest"] == []
    assert re.match(rf"search\.backend ({'|'.join(backends)}): no \1 config fits: hardware\.device_memory_limit "
                    r"1\.0 KiB is below", refused["refusal"]) if len(backends) > 1 else \
        refused["refusal"].startswith("hardware.device_memory_limit 1.0 KiB is below")
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(spec))      # the command a user runs, its text and exit
    r = sltune("plan", str(tmp_path / "spec.yaml"))
    assert r.returncode == 0, r.stderr
    for backend in backends:
        assert re.search(rf"largest that fits: {'' if backend == 'speedloader' else backend + ' '}b=2 N=2", r.stdout)
