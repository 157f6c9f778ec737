"""The tuning spec (sltune.tuning.spec): a bad spec fails before any trial, naming the field and the fix; what it
documents in the OpenAPI schema; its digest; a model folder as its source."""

from __future__ import annotations

import dataclasses

import pytest

from sltune.backend_knobs import knobs_of
from sltune.config import RuntimeKnobs
from sltune.tuning.cost.shape import shape_of
from sltune.tuning.space import Candidate
from sltune.tuning.spec import Search, TuningSpec
from tests.support.offload_specs import BOTH, TINY, spec
from tests.support.specs import BASE, admitted_spec, parse


@pytest.mark.parametrize("overrides,message", [
    ({"serach": {}}, "serach: unknown field"),
    ({"search": {"sub_batch_size": {"min": 8, "max": 2}}}, "search.sub_batch_size: min 8 > max 2; swap them"),
    ({"search": {"num_sub_batches": 4, "effective_batch_size": 16}}, "not both"),
    ({"search": {"strategy": "bayes"}}, "search.strategy"),
    ({"model": {"preset": "llama-huge"}}, "model.preset: Input should be 'llama-tiny', 'llama-tiny-tied'"),
    ({"model": {"preset": "llama-tiny", "hf_config": {"model_type": "llama"}}}, "exactly one of model.preset"),
    ({"model": {"hf_config": {"model_type": "llama", "auto_map": {"AutoModel": "evil.Model"}}}}, "can load code"),
    ({"model": {"hf_config": {"model_type": "bert"}}}, "'bert' is not supported"),
    ({"hardware": {"device_memory_limit": "lots"}}, "hardware.device_memory_limit"),
    ({"workload": {"seq_len": 1}}, "workload.seq_len"),
    ({"search": {"num_live_blocks": "many"}}, "search.num_live_blocks: expected an integer, a list of integers"),
    ({"search": {"sub_batch_size": 3, "effective_batch_size": 16}}, "search space is empty"),
    ({"search": {"kv_cache": "device"}}, "search.kv_cache places generation's KV caches; remove it or set "
                                         "workload.mode: generate"),
    ({"workload": {"mode": "generate"}, "search": {"kv_cache": ["gpu"]}}, "search.kv_cache"),
    ({"search": {"weights_on_device": 0.5}}, "search.weights_on_device keeps generation's weights on the device; "
                                             "remove it or set workload.mode: generate"),
    ({"workload": {"mode": "generate"}, "search": {"weights_on_device": [0, 2]}},
     "search.weights_on_device: 2 is not a share of the parameter bytes; give numbers from 0"),
    ({"workload": {"mode": "generate"}, "search": {"weights_on_device": "half"}},
     "search.weights_on_device: 'half' is not a share"),
    ({"workload": {"mode": "generate"}, "search": {"weights_on_device": []}}, "search.weights_on_device: give a share"),
    # JSON's null is null, not Python's None (#47)
    ({"search": {"backend": None}}, "search.backend: null is not a backend or a list of them; give speedloader"),
    ({"search": {"backend": ["speedloader", None]}}, "search.backend: null is not a backend; choose from"),
    ({"search": {"optimizer_offload": None}}, "search.optimizer_offload: null is not a list of places"),
    ({"search": {"param_offload": ["host", None]}}, "search.param_offload: null is not where"),
    ({"workload": {"mode": "generate"}, "search": {"weights_on_device": [0, None]}},
     "search.weights_on_device: null is not a share"),
])
def test_bad_specs_name_the_field(overrides, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("*", r"\*")):
        parse(**overrides)


def test_the_api_documents_search_weights_on_device_as_shares_from_0_to_1():
    """POST /tune's body in /openapi.json is this JSON schema (api/app.py)."""
    field = TuningSpec.model_json_schema()["$defs"]["Search"]["properties"]["weights_on_device"]
    assert field["description"].startswith("generate: shares of the parameter bytes to keep on the device")
    share = {"type": "number", "minimum": 0.0, "maximum": 1.0}
    assert field["anyOf"][:2] == [share, {"type": "array", "items": share, "minItems": 1, "maxItems": 64}]


def test_the_space_size_a_spec_reports_counts_the_shares_of_weights():
    many = {"sub_batch_size": list(range(1, 65)), "num_sub_batches": list(range(1, 65)), "num_live_blocks": 1,
            "kv_cache": "host"}
    with pytest.raises(ValueError, match="the search space has 24576 combinations"):    # 64*64*2*3 shares
        parse(workload={"mode": "generate"}, search={**many, "num_live_blocks": [1, 2]})
    parse(workload={"mode": "generate"}, search={**many, "weights_on_device": [0, 1]})  # 64*64*2


def test_reading_a_spec_back_builds_nothing_and_admitting_it_checks_it_against_the_models_shape(monkeypatch):
    """Parsing (a stored job read back by a worker, `export`, GET /jobs/{id}/config.yaml) neither builds the model's
    shape nor runs the cost model: a spec whose limit nothing fits reads back as it was stored. Admission (tune,
    plan, POST /tune) refuses it."""
    import sltune.tuning.cost.shape as shape

    data = {**BASE, "model": {"hf_config": {"model_type": "llama", "hidden_size": 96, "intermediate_size": 160,
                                            "num_hidden_layers": 3, "num_attention_heads": 4, "vocab_size": 300}},
            "hardware": {"device_memory_limit": 1024}}

    def never(*args):
        raise AssertionError("parsing built the model's shape")
    monkeypatch.setattr(shape, "_build", never)
    spec = TuningSpec.parse(data)
    assert spec.hardware.device_memory_limit == 1024 and TuningSpec.model_validate(spec.model_dump()) == spec
    monkeypatch.undo()
    with pytest.raises(ValueError, match=r"^spec: hardware.device_memory_limit 1.0 KiB is below"):
        admitted_spec(data)


def test_digest_identifies_a_spec():
    assert parse().digest() == parse().digest() != parse(name="other").digest()
    # a field given at its default is the spec without it: a field a later version adds does not orphan a job
    base = parse()
    explicit = parse(search={**BASE.get("search", {}), "optimizer_offload": ["host"]},
                     hardware={**BASE.get("hardware", {}), "disk_limit": None})
    assert explicit.digest() == base.digest()
    assert parse(search={**BASE.get("search", {}), "optimizer_offload": ["host", "disk"]}).digest() != base.digest()


def test_a_checkpoint_folder_is_a_model_source_and_its_saved_config_json_is_accepted_as_is(tmp_path):
    """model: {path: DIR} beside preset and hf_config; the config.json transformers writes (its version, dtype,
    architectures; older ones' _name_or_path and torch_dtype) is metadata, accepted and dropped, in load_config,
    a spec's path and a spec's inline hf_config alike; keys that can load code stay refused."""
    import json

    from sltune.models import build, load_config
    from sltune.models.presets import hf_config_schema

    folder = tmp_path / "ckpt"
    build("llama-tiny").config.save_pretrained(folder)
    saved = json.loads((folder / "config.json").read_text())
    assert {"transformers_version", "dtype"} <= set(saved)
    saved.update(_name_or_path="meta-llama/x", torch_dtype="bfloat16", architectures=["LlamaForCausalLM"])
    (folder / "config.json").write_text(json.dumps(saved))
    assert load_config(folder).num_key_value_heads == 2
    spec = parse(model={"path": str(folder / ".." / "ckpt"), "dtype": "bfloat16"})
    assert spec.model.source == str(folder.resolve()) and spec.model.describe() == "ckpt (model folder)"
    assert shape_of(spec.model.source) == shape_of("llama-tiny")         # the shape is the folder's config.json
    assert parse(model={"hf_config": saved}).model.hf_config == saved
    for bad, message in (({"auto_map": {"x": "y"}}, "'auto_map' is not accepted"),
                         ({"_commit_hash": "abc"}, "'_commit_hash' is not accepted"),
                         ({"name_or_path": "x"}, "'name_or_path' is not accepted")):
        with pytest.raises(ValueError, match=message):
            parse(model={"hf_config": {**saved, **bad}})
    (folder / "config.json").write_text(json.dumps({**saved, "trust_remote_code": True}))
    with pytest.raises(ValueError, match="model.path: its config.json: 'trust_remote_code' is not accepted"):
        parse(model={"path": str(folder)})
    with pytest.raises(ValueError, match="model.path: no such folder; give a Hugging Face model folder"):
        parse(model={"path": str(tmp_path / "nowhere")})
    with pytest.raises(ValueError, match="model.path: the folder has no config.json"):
        parse(model={"path": str(tmp_path)})
    with pytest.raises(ValueError, match="exactly one of model.preset .*, model.hf_config .* or model.path"):
        parse(model={"preset": "llama-tiny", "hf_config": saved})
    refused = hf_config_schema()["propertyNames"]["not"]["anyOf"]     # the OpenAPI document says the same
    assert "transformers_version" not in refused[0]["enum"] and "auto_map" in refused[0]["enum"]
    assert refused[1] == {"allOf": [{"pattern": "^_"},
                                    {"not": {"enum": ["_name_or_path", "_remove_final_layer_norm"]}}]}


def test_the_optimizer_and_mixed_precision_reach_the_trials_and_best_yaml():
    import yaml

    from sltune.config import SpeedLoaderConfig
    from sltune.training.optimizer import OptimizerConfig
    from sltune.tuning.report.result import export_yaml
    from sltune.tuning.search.trials import trial_spec

    default = parse()
    assert default.optimizer == OptimizerConfig() and default.model.mixed_precision is True
    spec = parse(model={"preset": "llama-tiny", "dtype": "bfloat16", "mixed_precision": False},
                 optimizer={"name": "sgd", "lr": 0.05, "momentum": 0.9})
    assert spec.digest() != parse(model={"preset": "llama-tiny", "dtype": "bfloat16"},
                                  optimizer={"name": "sgd", "lr": 0.05, "momentum": 0.9}).digest()
    trial = trial_spec(spec, Candidate(2, 1, 1), None)
    assert trial.mixed_precision is False and trial.dtype == "bfloat16"
    assert trial.optimizer == OptimizerConfig(name="sgd", lr=0.05, momentum=0.9)
    best = {"config": {**Candidate(2, 1, 1).knobs(), "schedule": "speedloader"}, "trial_number": 0}
    text = export_yaml(spec, {"job_id": "j", "strategy": "oneshot", "best": best, "trials": [], "predicted": {},
                              "margins": {}, "binding_limit": None, "models": {}, "search_space": {}})
    data = yaml.safe_load(text)
    cfg = SpeedLoaderConfig.from_dict(data)             # what `sltune train --config` reads
    assert cfg.mixed_precision is False and cfg.dtype == "bfloat16" and not cfg.has_master
    assert OptimizerConfig.from_dict(data["optimizer"]) == spec.optimizer
    assert data["provenance"]["model"] == {"preset": "llama-tiny", "dtype": "bfloat16", "mixed_precision": False}
    for bad, message in (({"name": "adam"}, "optimizer.name"), ({"lr": 0}, "optimizer.lr"),
                         ({"lr": True}, "optimizer: lr is true or false; give a number"),
                         ({"betas": [0.9, 1.5]}, "optimizer.betas: each beta must be in"),
                         ({"lr_schedule": "cosine"}, "optimizer.lr_schedule: unknown field")):
        with pytest.raises(ValueError, match=message):
            parse(optimizer=bad)
    schema = TuningSpec.model_json_schema()        # POST /tune's body in /openapi.json
    assert schema["properties"]["optimizer"]["$ref"].endswith("OptimizerConfig")
    assert {"path", "mixed_precision"} <= set(schema["$defs"]["ModelSpec"]["properties"])


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


def test_a_search_sweeps_the_runtime_knobs_marked_searched_and_a_candidate_carries_them_by_name():
    """The knobs a search sweeps are declared searched where they are declared (RuntimeKnobs), and nowhere else:
    search.* has a field of that name (schedule alone is the job's, one value), the spec reference documents it with
    the knob's own doc, and a candidate carries it under the same name, which a trial's config records."""
    searched = {name for name, knob in knobs_of(RuntimeKnobs).items() if knob.searched}
    assert searched == (set(Search.model_fields) & set(RuntimeKnobs.model_fields)) - {"schedule"}
    assert searched <= {f.name for f in dataclasses.fields(Candidate)}
    for name in ("sub_batch_size", "num_sub_batches", "num_live_blocks"):
        assert Search.model_fields[name].description.startswith(RuntimeKnobs.model_fields[name].description)
    c = Candidate(2, 3, 1, "offload", optimizer_offload="disk", param_offload="disk")
    assert c.knobs() == {name: getattr(c, name) for name in c.knobs()} and Candidate.from_knobs(c.knobs()) == c


def test_nodes_and_ranks_per_node_give_world_size_and_need_a_cluster():
    """hardware.world_size, nodes and ranks_per_node: any two give the third, three must agree, and ranks over
    several nodes need hardware.executor ray, as do trials side by side; each refusal names the fields."""
    hw = TuningSpec.parse({**BASE, "hardware": {"executor": "ray", "nodes": 2, "ranks_per_node": 3}}).hardware
    assert (hw.world_size, hw.nodes, hw.per_node) == (6, 2, 3)
    hw = TuningSpec.parse({**BASE, "hardware": {"executor": "ray", "nodes": 2, "world_size": 4}}).hardware
    assert hw.per_node == 2
    with pytest.raises(ValueError, match=r"^spec: hardware\.world_size 5 is not nodes x ranks_per_node = 4"):
        TuningSpec.parse({**BASE, "hardware": {"executor": "ray", "nodes": 2, "ranks_per_node": 2, "world_size": 5}})
    with pytest.raises(ValueError, match=r"hardware\.world_size 3 does not split over 2 nodes"):
        TuningSpec.parse({**BASE, "hardware": {"executor": "ray", "nodes": 2, "world_size": 3}})
    with pytest.raises(ValueError, match=r"^spec: hardware\.nodes: 2 nodes need a cluster: set hardware\.executor ray"):
        TuningSpec.parse({**BASE, "hardware": {"nodes": 2, "ranks_per_node": 1}})
    with pytest.raises(ValueError, match=r"^spec: hardware\.parallel_trials: 2 trials at once need nodes of their own: "
                                         r"set hardware\.executor ray"):
        TuningSpec.parse({**BASE, "hardware": {"parallel_trials": 2}})
    hw = TuningSpec.parse({**BASE, "hardware": {"executor": "ray", "parallel_trials": 2}}).hardware
    assert hw.parallel_trials == 2
    # a stored spec reads back the same
    spec = TuningSpec.parse({**BASE, "hardware": {"executor": "ray", "nodes": 2, "ranks_per_node": 1}})
    assert TuningSpec.model_validate(spec.model_dump(mode="json")) == spec
