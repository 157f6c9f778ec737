"""The tuner knows param_offload: a spec sweeps search.param_offload, trials and best.yaml carry it, the prior's host
floor falls to a window of the weights and gradients (their files and a step's traffic on disk instead), `plan`
offers it, and a refusal names it under what would fit. The runtime itself is tests/unit/test_param_offload.py's."""

from __future__ import annotations

import dataclasses
import re

import pytest

from sltune.config import SpeedLoaderConfig
from sltune.runtime.disk.layout import padded
from sltune.settings import Settings
from sltune.tuning.cost import feasible
from tests.support.specs import admitted_spec
from sltune.tuning.cost.feasible import FreeSpace, Limit
from sltune.tuning.cost.prior import GRAD_UNITS, SPARE, STAGED, predict
from sltune.tuning.cost.setup import Setup
from sltune.tuning.cost.shape import shape_of
from sltune.tuning.report import plan_from_prior
from sltune.tuning.report.plan_from_prior import plan_spec
from sltune.tuning.report.result import best_config
from sltune.tuning.search.fit import MODELS, variables
from sltune.tuning.search.state import SearchState
from sltune.tuning.search.strategies import OneShotStrategy
from sltune.tuning.search.trials import trial_spec
from sltune.tuning.space import Candidate, SearchSpace
from sltune.tuning.spec import TuningSpec

GiB = 2**30
TINY = {"name": "t", "model": {"preset": "llama-tiny", "dtype": "bfloat16"}, "workload": {"seq_len": 32}}
BOTH = {"optimizer_offload": ["host", "disk"], "param_offload": ["host", "disk"]}
# llama-2-7b in bfloat16, mixed precision, AdamW: the goal is a plan under 17 GiB of host memory
SEVEN_B = {"name": "7b", "model": {"preset": "llama-2-7b", "dtype": "bfloat16"}, "workload": {"seq_len": 128},
           "search": {"sub_batch_size": [1], "num_sub_batches": [1], "num_live_blocks": [1]}}
HOST = Candidate(1, 1, 1)
OPTIMIZER = Candidate(1, 1, 1, optimizer_offload="disk")
WEIGHTS = Candidate(1, 1, 1, optimizer_offload="disk", param_offload="disk")


def spec(search: dict | None = None, **sections) -> TuningSpec:
    base = {**TINY, **sections}
    return TuningSpec.parse({**base, "search": {"sub_batch_size": [1, 2], "num_sub_batches": [1, 2],
                                                "num_live_blocks": [1], **(search or {})}})


def seven_b(free: int, monkeypatch, **search) -> dict:
    """The 7B spec planned with `free` bytes free where trials offload to, and a trial process's own bytes pinned
    at 0.35 GiB: plan reads the last figure measured here, else this process's resident memory (a test process's
    grows with the tests it has run: the refusal's minimum read 117.0 GiB after some, 116.x after others)."""
    monkeypatch.setattr(feasible, "free_bytes", lambda folder: free)
    monkeypatch.setattr(plan_from_prior, "trial_baseline", lambda *args, **kwargs: int(0.35 * GiB))
    return {**SEVEN_B, "search": {**SEVEN_B["search"], **search}}


# -- the spec and the space ---------------------------------------------------------------------------------------
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


@pytest.mark.parametrize("search,sections,message", [
    ({"param_offload": ["host", "nvme"]}, {}, "search.param_offload: 'nvme' is not where the dtype copy of the "
                                              "weights can live; give host, disk or [host, disk]"),
    ({"param_offload": []}, {}, "search.param_offload: [] is not a list of places"),
    ({"param_offload": "disk"}, {}, "search.param_offload disk: training steps each unit's weights file with its "
                                    "optimizer block, and search.optimizer_offload has no disk; add disk to "
                                    "search.optimizer_offload"),
    ({**BOTH, "schedule": "resident"}, {}, "search.optimizer_offload: the resident schedule"),
    ({"param_offload": "disk", "schedule": "resident"}, {"workload": {"mode": "generate"}},
     "search.param_offload: the resident schedule keeps every weight on the device"),
    ({}, {"hardware": {"disk_limit": "1GiB"}}, "hardware.disk_limit bounds the files of search.optimizer_offload or "
                                               "search.param_offload disk"),
])
def test_a_bad_param_offload_is_refused_in_one_line_naming_the_field_and_the_fix(search, sections, message):
    with pytest.raises(ValueError) as refused:
        spec(search, **sections)
    assert message in str(refused.value) and "\n" not in str(refused.value), str(refused.value)


def test_param_offload_is_speedloaders_knob():
    with pytest.raises(ValueError, match=r"search\.param_offload is SpeedLoader's, and search\.backend \[fsdp\] does "
                                         "not include speedloader; add speedloader to search.backend, or remove "
                                         r"search\.param_offload"):
        TuningSpec.parse({**TINY, "search": {"backend": "fsdp", "param_offload": ["host", "disk"],
                                             "sub_batch_size": [1]}})


def test_the_openapi_schema_of_a_spec_documents_search_param_offload():
    """POST /tune's body in /openapi.json is TuningSpec's JSON schema (api/app.py)."""
    field = TuningSpec.model_json_schema()["$defs"]["Search"]["properties"]["param_offload"]
    assert field["items"]["enum"] == ["host", "disk"] and field["type"] == "array"
    assert field["description"].startswith("where the dtype copy of the weights the device loads lives")
    disk = TuningSpec.model_json_schema()["$defs"]["Hardware"]["properties"]["disk_limit"]
    assert "search.param_offload" in disk["description"]


# -- trials, best.yaml ----------------------------------------------------------------------------------------------
def test_a_trial_of_the_weights_on_disk_runs_them_there_in_the_runners_folder(tmp_path):
    s = spec(BOTH)
    trial = trial_spec(s, WEIGHTS, None, offload_dir=tmp_path)
    assert (trial.param_offload, trial.optimizer_offload, trial.offload_dir) == ("disk", "disk", str(tmp_path))
    assert trial.knobs()["param_offload"] == "disk"
    assert Candidate.from_knobs(trial.knobs()) == WEIGHTS          # what a stored trial reads back
    assert WEIGHTS.knobs()["param_offload"] == "disk" and "param_offload" not in OPTIMIZER.knobs()
    assert str(WEIGHTS) == "b=1 N=1 k=1 optimizer_offload=disk param_offload=disk"
    assert trial_spec(s, OPTIMIZER, None, offload_dir=tmp_path).param_offload == "host"
    with pytest.raises(ValueError, match="param_offload disk needs the runner's offload folder"):
        trial_spec(s, WEIGHTS, None)
    gen = spec({"param_offload": "disk", "num_sub_batches": [1]}, workload={"mode": "generate"})
    alone = Candidate(1, 1, 1, kv_cache="host", weights_on_device=0.0, param_offload="disk")
    trial = trial_spec(gen, alone, None, offload_dir=tmp_path)
    assert (trial.param_offload, trial.optimizer_offload, trial.mode) == ("disk", "host", "generate")


def test_best_yaml_carries_the_weights_on_disk_and_names_no_folder(tmp_path):
    s = spec(BOTH)
    result = {"best": {"config": {**WEIGHTS.knobs(), "schedule": "speedloader"}}}
    cfg = best_config(s, result)
    assert (cfg.param_offload, cfg.optimizer_offload, cfg.offload_dir) == ("disk", "disk", None)
    assert best_config(s, result, offload_dir=str(tmp_path)).offload_dir == str(tmp_path)
    path = tmp_path / "best.yaml"
    best_config(s, result, offload_dir=str(tmp_path)).to_yaml(path)
    assert SpeedLoaderConfig.from_yaml(path).param_offload == "disk"      # what `sltune train --config` reads
    host = best_config(s, {"best": {"config": {**OPTIMIZER.knobs(), "schedule": "speedloader"}}})
    assert host.param_offload == "host" and host.optimizer_offload == "disk"


# -- the prior -----------------------------------------------------------------------------------------------------
def test_the_runtime_window_constants_are_the_priors():
    from sltune.runtime.disk import gradwindow
    from sltune.runtime.disk import weightfiles

    assert SPARE == weightfiles.SPARE and STAGED == 1 + weightfiles.WRITES_IN_FLIGHT
    assert GRAD_UNITS == gradwindow.SLOTS


def test_over_two_ranks_each_holds_and_files_its_shards_of_the_weights():
    """sltune.runtime.sharding: each rank's window holds its 1/W shard of each unit, and its files hold its shards;
    the prior's figures are both ranks' together, so the window and the files stay about one rank's."""
    assert spec(BOTH, hardware={"world_size": 2}).hardware.world_size == 2     # no longer refused
    shape = shape_of("llama-2-7b", "bfloat16")
    one, two = (predict(Setup("llama-2-7b", shape, seq_len=128, world_size=w), WEIGHTS) for w in (1, 2))
    for terms in ("host_terms", "disk_terms"):
        for what, n in dict(getattr(one, terms)).items():
            if what.startswith(("the weights'", "the gradients' window")):
                assert n <= dict(getattr(two, terms))[what] <= n + 2 * 4096 * 8, what   # padding per rank and unit
    reads = {w: r for w, r, _ in one.traffic_terms}
    assert {w: r for w, r, _ in two.traffic_terms}["the weights read at each load"] >= \
        reads["the weights read at each load"]


def test_the_host_floor_of_a_7b_falls_to_the_window_with_the_weights_on_disk():
    shape = shape_of("llama-2-7b", "bfloat16")
    recipe = Setup("llama-2-7b", shape, seq_len=128)
    host, optimizer, weights = (predict(recipe, c) for c in (HOST, OPTIMIZER, WEIGHTS))
    assert host.host > 100 * GiB and 40 * GiB < optimizer.host < 50 * GiB
    assert weights.host < 17 * GiB                                          # the goal, predicted
    terms = dict(weights.host_terms)
    assert not any(t.startswith("the weights in") or t.endswith(" gradients") for t in terms)
    # a window of units, each a unit's dtype bytes: far below the model's 12.6 GiB of weights and 25.1 of gradients
    layer = padded(shape.layer_bytes)
    assert terms["the weights' window: 2 stepped copies staged"] == 2 * layer
    assert not any("spare" in t for t in terms)                           # the window keeps no free buffer
    # the two largest units' float32 gradient sums (sltune.runtime.disk.gradwindow): two layers, each above the
    # embedding
    assert terms["the gradients' window: the 2 largest units' (param_offload disk)"] == \
        2 * padded(shape.layer_bytes // 2 * 4)
    assert 2 * layer <= terms["the weights' window: units read ahead (param_offload disk)"] <= 4 * layer
    # on disk: the disk tier's files as before, and the weights' files twice (a step writes its new version first)
    disk = dict(weights.disk_terms)
    assert dict(optimizer.disk_terms).items() <= disk.items()
    assert disk["the weights' files (param_offload disk)"] == \
        disk["the weights' new version a step writes before it commits"]
    assert shape.param_bytes <= disk["the weights' files (param_offload disk)"] < 1.001 * shape.param_bytes
    assert not any("gradients" in t for t in disk)                         # bfloat16 with no clipping: no spill
    # the device prefetches no unit: its file is read ahead into host memory instead
    assert weights.device < host.device
    assert "weights prefetched" not in dict(weights.device_terms) and "weights prefetched" in dict(host.device_terms)


def test_a_steps_disk_traffic_is_the_weights_twice_and_the_new_version_beside_the_disk_tiers():
    shape = shape_of("llama-tiny", "bfloat16")
    recipe = Setup("llama-tiny", shape, seq_len=32)
    tier = predict(recipe, OPTIMIZER)
    both = predict(recipe, WEIGHTS)
    moved = {what: (r, w) for what, r, w in both.traffic_terms}
    tier_bytes = tier.disk // 2
    assert tier.disk_read == tier.disk_written == tier_bytes
    weights = sum(padded(n) for n in (shape.embed_bytes, shape.head_bytes, *[shape.layer_bytes] * shape.layers))
    # forward and backward load every unit, but the last group and the head, live together once
    last = padded(shape.layer_bytes) + padded(shape.head_bytes)
    assert moved["the weights read at each load"] == (2 * weights - last, 0)
    assert moved["each stepped unit's new weights"] == (0, weights)       # a master: the new copy is written only
    assert both.disk_read == tier_bytes + 2 * weights - last and both.disk_written == tier_bytes + weights
    assert both.to_dict()["disk_read_bytes_per_step"] == both.disk_read
    # canonical loads every unit for each of its N micro-batches
    canonical = Setup("llama-tiny", shape, schedule="canonical", seq_len=32)
    assert dict((w, r) for w, r, _ in predict(canonical, Candidate(1, 3, 1, optimizer_offload="disk",
                                                                    param_offload="disk")).traffic_terms
                )["the weights read at each load"] == 3 * (2 * weights - last)
    # no master: each unit's file is read once more to step its values
    plain = Setup("llama-tiny", shape, mixed_precision=False, seq_len=32)
    assert dict((w, r) for w, r, _ in predict(plain, WEIGHTS).traffic_terms)["each stepped unit's new weights"] \
        == weights


SPILL = "the gradients a waiting step spills (loss scaling, clipping, no master)"


def test_a_step_that_waits_for_every_gradient_spills_them_to_disk():
    """float16's loss scaling and clipping need the global norm before any unit steps, and a step without a master
    cannot be undone part-way: the gradients wait in files."""
    half = shape_of("llama-tiny", "float16")
    grads = predict(Setup("llama-tiny", half, seq_len=32), WEIGHTS)
    spill = dict(grads.disk_terms)[SPILL]
    assert half.param_bytes // 2 * 4 <= spill < half.param_bytes // 2 * 4 + 8 * 4096     # float32 sums, page-padded
    assert ("the gradients a waiting step spills and reads back", spill, spill) in grads.traffic_terms
    bf16 = shape_of("llama-tiny", "bfloat16")
    assert SPILL not in dict(predict(Setup("llama-tiny", bf16, seq_len=32), WEIGHTS).disk_terms)
    assert SPILL in dict(predict(Setup("llama-tiny", bf16, seq_len=32, clips=True), WEIGHTS).disk_terms)
    plain = predict(Setup("llama-tiny", bf16, mixed_precision=False, seq_len=32), WEIGHTS)
    assert dict(plain.disk_terms)[SPILL] >= bf16.param_bytes                   # dtype sums
    # canonical sums every micro-batch's gradients on the host and keeps them whole: no window, no spill
    canonical = predict(Setup("llama-tiny", half, schedule="canonical", seq_len=32), WEIGHTS)
    assert SPILL not in dict(canonical.disk_terms) and "float32 gradients" in dict(canonical.host_terms)
    assert not any(t.startswith("the gradients' window") for t, _ in canonical.host_terms)
    # a host config is untouched by any of it
    assert predict(Setup("llama-tiny", bf16, seq_len=32, clips=True), HOST).disk == 0


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
    assert probes and all(c.weights_on_disk for c in probes if c.b == 1 and c.n == 1)
    assert st.predict(WEIGHTS).fits and not st.predict(OPTIMIZER).fits
    # what stops a config growing names the host when its weights back in host memory would not fit
    assert "host" in st.binding_limit(WEIGHTS)


# -- plan and refusals --------------------------------------------------------------------------------------------
def test_plan_puts_a_7b_under_17_gib_of_host_with_the_weights_on_disk(monkeypatch, tmp_path):
    data = seven_b(2 * 2**40, monkeypatch, **BOTH)
    r = plan_spec(data, "7b.yaml", host_memory_limit="17GiB", disk_limit="1TiB",
                  settings=Settings(data_dir=tmp_path), disk_flag="--disk-limit")
    assert r["refusal"] is None and r["fitting"] == 1
    (big,) = r["largest"]
    assert big["config"]["param_offload"] == "disk" and big["config"]["optimizer_offload"] == "disk"
    prior = big["prior"]
    assert prior["peak_host_bytes"] < 17 * GiB and 170 * GiB < prior["peak_disk_bytes"] < 180 * GiB
    assert prior["disk_read_bytes_per_step"] > prior["disk_write_bytes_per_step"] > 0
    assert r["limits"]["disk_limit"] == 2**40
    assert r["limits"]["disk_limit_note"] == (f"--disk-limit, a what-if: this machine has 2.0 TiB free in "
                                              f"{tmp_path / 'offload'}")
    over = {tuple(sorted(row["config"].items())): row["over"] for row in r["configs"]}
    assert ["host"] in over.values()                  # the optimizer on disk alone still needs 43.0 GiB


def test_plan_says_when_the_free_space_overrides_a_larger_disk_limit(monkeypatch, tmp_path):
    """The spec's hardware.disk_limit is held to the free space where trials offload to, as tune holds it; plan's
    --disk-limit is a what-if, which stands (tests/unit/test_refusals_newcomer.py)."""
    data = seven_b(80 * GiB, monkeypatch, **BOTH)
    data["hardware"] = {**data.get("hardware", {}), "disk_limit": "1TiB"}
    r = plan_spec(data, "7b.yaml", host_memory_limit="17GiB", settings=Settings(data_dir=tmp_path))
    root = tmp_path / "offload"
    assert r["limits"]["disk_limit"] == 80 * GiB
    assert r["limits"]["disk_limit_note"] == (f"hardware.disk_limit is 1.0 TiB but only 80.0 GiB is free in {root}: "
                                              "planning with 80.0 GiB")
    assert r["refusal"].startswith(f"the 80.0 GiB free in {root} (hardware.disk_limit 1.0 TiB is more than is free "
                                   "there: the free space applies) is below the 175.7 GiB")
    assert f"at least 175.7 GiB free in {root}" in r["refusal"] and "a the " not in r["refusal"]
    what_if = plan_spec(data, "7b.yaml", host_memory_limit="17GiB", disk_limit="1TiB",
                        settings=Settings(data_dir=tmp_path), disk_flag="--disk-limit")
    assert what_if["limits"]["disk_limit"] == 2**40 and what_if["refusal"] is None


def test_a_host_refusal_names_the_weights_on_disk_under_what_would_fit(monkeypatch, tmp_path):
    """The issue: a 17 GiB refusal for a 7B said 'no change of dtype, precision or optimizer' where disk could
    carry it."""
    data = seven_b(2 * 2**40, monkeypatch)           # the spec tries neither place on disk
    r = plan_spec(data, "7b.yaml", host_memory_limit="17GiB", settings=Settings(data_dir=tmp_path))
    refusal = r["refusal"]
    assert refusal.startswith("hardware.host_memory_limit 17.0 GiB is below the 116.")
    fit = refusal.split("What would fit: ", 1)[1]
    assert "no change of dtype, precision or optimizer" not in fit
    named = re.match(r"search\.param_offload \[host, disk\] with search\.optimizer_offload \[host, disk\] \(the "
                     r"weights, the master and the optimizer state in files, a window of the weights and gradients "
                     r"in host memory: (\d+\.\d) GiB in host memory, 175\.7 GiB on disk\)", fit)
    assert named and 4 < float(named.group(1)) < 17, fit
    assert "search.optimizer_offload [host, disk] (the master" not in fit   # 43.0 GiB: no fit under 17
    # too little disk for it: it is still named, with the disk it takes, before the host memory the rest would need
    monkeypatch.setattr(feasible, "free_bytes", lambda folder: 80 * GiB)
    fit = plan_spec(data, "7b.yaml", host_memory_limit="17GiB",
                    settings=Settings(data_dir=tmp_path))["refusal"].split("What would fit: ", 1)[1]
    assert fit.startswith("no change of dtype, precision or optimizer; search.param_offload [host, disk] with "
                          "search.optimizer_offload [host, disk] (")
    assert f"GiB in host memory) with at least 175.7 GiB free in {tmp_path / 'offload'}; or a " \
           "hardware.host_memory_limit of at least 116." in fit


def test_a_disk_refusal_alone_offers_no_more_disk():
    """Where only the disk is short, the weights on disk (more files) are no answer: not named."""
    s = admitted_spec({**SEVEN_B, "search": {**SEVEN_B["search"], "optimizer_offload": "disk"}})
    shape = shape_of("llama-2-7b", "bfloat16")
    limits = [Limit("disk", 10 * GiB, "hardware.disk_limit")]
    text = feasible.shortfall(Setup.of_spec(s, shape), SearchSpace(s, shape).candidates, None, None,
                              disk_limit=10 * GiB)
    assert text is not None and "param_offload" not in text
    assert feasible.to_disk(Setup.of_spec(s, shape), SearchSpace(s, shape).candidates)[0][0] == \
        "search.param_offload [host, disk]"
    assert limits[0].raised(GiB) == "a hardware.disk_limit of at least 1.0 GiB (with that much free where trials " \
                                    "offload to)"


def test_the_free_space_reads_as_a_place_never_as_a_the(tmp_path):
    free = Limit("disk", 80 * GiB, FreeSpace(tmp_path, 2**40, 80 * GiB))
    assert free.raised(100 * GiB) == f"at least 100.0 GiB free in {tmp_path}"
    assert free.said() == (f"the 80.0 GiB free in {tmp_path} (hardware.disk_limit 1.0 TiB is more than is free "
                           "there: the free space applies)")
    assert FreeSpace(tmp_path, 2**40, 80 * GiB).overrides() == (f"hardware.disk_limit is 1.0 TiB but only 80.0 GiB "
                                                                f"is free in {tmp_path}: planning with 80.0 GiB")
    assert FreeSpace(tmp_path).overrides() == ""
    assert Limit("disk", GiB, "--disk-limit").raised(2 * GiB).startswith("a --disk-limit of at least 2.0 GiB")


def test_the_readme_table_is_what_plan_predicts():
    """The README's 7B/13B/70B rows are the prior's figures, not typed in: a change to the prior shows here."""
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    places = [Candidate(1, 4, 1), Candidate(1, 4, 1, optimizer_offload="disk"),
              Candidate(1, 4, 1, optimizer_offload="disk", param_offload="disk")]
    for model, name in [("llama-2-7b", "Llama-2-7B"), ("llama-2-13b", "Llama-2-13B"), ("llama-2-70b", "Llama-2-70B")]:
        recipe = Setup(model, shape_of(model, "bfloat16"), seq_len=2048, device="cuda")
        host, optimizer, weights = (predict(recipe, c) for c in places)
        once = dataclasses.replace(recipe, disk_versions=1)
        optimizer1, weights1 = (predict(once, c) for c in places[1:])
        row = (f"| {name} | {host.host / GiB:.1f} GiB | {optimizer.host / GiB:.1f} GiB | "
               f"{weights.host / GiB:.1f} GiB | "
               f"{optimizer.disk / GiB:.0f} / {weights.disk / GiB:.0f} GiB | "
               f"{optimizer1.disk / GiB:.0f} / {weights1.disk / GiB:.0f} GiB | {weights.device / GiB:.1f} GiB |")
        assert row in readme, row
