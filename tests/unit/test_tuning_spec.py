"""A bad spec fails before any trial, naming the field and the fix."""

import re

import pytest

from tests.support.specs import admitted_spec
from sltune.tuning.search.fit import MODELS, variables
from sltune.tuning.cost.shape import shape_of
from sltune.tuning.space import Candidate, SearchSpace
from sltune.tuning.spec import TuningSpec
from sltune.tuning.search.state import SearchState
from tests.support.cli import sltune

BASE = {"name": "t", "model": {"preset": "llama-tiny"}, "workload": {"seq_len": 32}}


def parse(**overrides):
    data = {**BASE, **overrides}
    return admitted_spec(data)


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


@pytest.mark.parametrize("preset", ["llama-tiny", "llama-tiny-tied", "gpt2-tiny"])
def test_the_tuners_kept_bytes_are_what_the_engine_keeps(preset):
    """The fits and the pruning floor predict a share's kept bytes from the model's shape; the engine keeps
    units of the built model: the same units, so the same bytes, for every k (3 does not divide 4 layers)."""
    from sltune import SpeedLoaderConfig, SpeedLoaderEngine
    from sltune.models import build

    shape = shape_of(preset)
    for k in (1, 2, 3):
        for share in (0.0, 0.3, 0.5, 0.8, 1.0):
            cfg = SpeedLoaderConfig(num_live_blocks=k, weights_on_device=share, memory_tracking="never")
            engine = SpeedLoaderEngine(build(preset), cfg, optimizer=None)
            assert sum(u.nbytes for u in engine.kept_units) == shape.kept_bytes(k, share), (k, share)


def test_a_share_whose_kept_weights_cannot_fit_is_over_the_device_limit_before_any_trial():
    shape = shape_of("llama-tiny")
    spec = parse(workload={"mode": "generate"}, hardware={"device_memory_limit": 900_000},
                 search={"sub_batch_size": 1, "num_sub_batches": 1, "num_live_blocks": [1, 4], "kv_cache": "host"})
    with pytest.raises(ValueError) as refused:          # llama-tiny's 1001728 parameter bytes, all kept
        parse(workload=spec.workload.model_dump(), hardware={"device_memory_limit": 900_000},
              search={"weights_on_device": 1})
    assert str(refused.value) == (
        "spec: search.weights_on_device: every share keeps more on the device than hardware.device_memory_limit "
        "878.9 KiB holds: the least, 1 at num_live_blocks=1, needs 978.2 KiB (1001728 bytes) with the largest unit "
        "still streamed in; add a smaller share (0 keeps none) or raise the limit")
    state = SearchState(spec, shape, SearchSpace(spec, shape))
    assert not state.fits                                           # no trial, no fit: known from the shape
    assert state.predict(Candidate(1, 1, 1, kv_cache="host", weights_on_device=1.0)).over == ["device"]
    assert state.predict(Candidate(1, 1, 1, kv_cache="host", weights_on_device=0.5)).fits       # 632064 bytes at least
    # one group of all 4 layers does not fit in half, and streamed in it lands beside the kept embedding and head
    assert state.predict(Candidate(1, 1, 4, kv_cache="host", weights_on_device=0.5)).over == ["device"]
    assert state.predict(Candidate(1, 1, 4, kv_cache="host", weights_on_device=0.0)).fits


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


def needed(message: str) -> int:
    """The bytes a refusal says the smallest config needs."""
    return int(re.search(r"\((\d+) bytes\) the smallest config", message).group(1))


def test_a_limit_below_what_the_smallest_config_needs_says_that_minimum():
    """Each limit is held to the smallest config's prior (sltune.tuning.cost.prior, the process left out): refused one
    byte below it, term by term, and accepted at it; the prior is never below what the engine's units alone hold."""
    shape = shape_of("llama-tiny")
    with pytest.raises(ValueError, match=r"hardware.device_memory_limit .* below the .* the smallest config "
                                         r"\(b=1 N=1 k=1\) is predicted to need on the device: .*gradients") as refused:
        parse(hardware={"device_memory_limit": 1024})
    need = needed(str(refused.value))
    assert need >= shape.min_device_bytes("train")          # the live unit and its gradients, at least
    with pytest.raises(ValueError, match=rf"\({need} bytes\)"):
        parse(hardware={"device_memory_limit": need - 1})
    parse(hardware={"device_memory_limit": need})
    # what training holds per parameter: the weights in dtype; under a float32 master (mixed bfloat16) the
    # master, float32 gradients and the optimizer's state in float32, else gradients and state in dtype; the host
    # limit holds those, the boundary activations and (on the CPU) the device's buffers too
    n = shape.param_bytes // 4
    for model, optimizer, per_param, terms, would in (
            ({"dtype": "bfloat16"}, {}, 2 + 4 + 4 + 8, "the weights in bfloat16 0.5, a float32 master copy 1.0, "
             "float32 gradients 1.0, AdamW's two moments in float32 1.9", "model.mixed_precision false"),
            ({"dtype": "bfloat16", "mixed_precision": False}, {}, 2 + 2 + 4, "the weights in bfloat16 0.5, bfloat16 "
             "gradients 0.5, AdamW's two moments in bfloat16 1.0", "optimizer sgd without momentum"),
            ({"dtype": "float16"}, {"name": "sgd", "momentum": 0.9}, 2 + 4 + 4 + 4, "the weights in float16 0.5, a "
             "float32 master copy 1.0, float32 gradients 1.0, SGD's momentum buffer in float32 1.0",
             "model.mixed_precision false"),
            ({}, {"name": "sgd"}, 4 + 4, "the weights in float32 1.0, float32 gradients 1.0", "model.dtype bfloat16")):
        model = {"preset": "llama-tiny", **model}
        held = n * per_param
        assert shape_of("llama-tiny", model.get("dtype", "float32")).min_host_bytes(
            "train", model.get("mixed_precision", True), parse(optimizer=optimizer).optimizer) == held
        # (the weights and the optimizer on disk come first where they fit: search.param_offload, optimizer_offload)
        with pytest.raises(ValueError, match=r"hardware.host_memory_limit .* predicted to need in host memory: "
                                             + re.escape(terms) + r".*device buffers .*What would fit: "
                                             r"(search\.\w+_offload .*; or )?" + would) as no:
            parse(model=model, optimizer=optimizer, hardware={"host_memory_limit": held})
        need = needed(str(no.value))
        assert need > held
        with pytest.raises(ValueError, match=rf"\({need} bytes\)"):
            parse(model=model, optimizer=optimizer, hardware={"host_memory_limit": need - 1})
        parse(model=model, optimizer=optimizer, hardware={"host_memory_limit": need})
    with pytest.raises(ValueError, match=r"in host memory: the weights in bfloat16 489.1, boundary activations "
                                         r"20.0, device buffers"):     # generation: no gradients or optimizer
        parse(model={"preset": "llama-tiny", "dtype": "bfloat16"}, workload={"mode": "generate"},
              hardware={"host_memory_limit": 2 * n})


def test_cli_refuses_a_bad_spec_before_any_trial(tmp_path):
    spec = tmp_path / "bad.yaml"
    spec.write_text("name: x\nmodel: {preset: llama-tiny}\nsearch: {max_trails: 3}\n")
    db = tmp_path / "jobs.db"
    out = sltune("tune", str(spec), "--db", f"sqlite:///{db}")
    assert out.returncode == 2
    assert "search.max_trails: unknown field" in out.stderr and "Traceback" not in out.stderr
    assert not db.exists()


def test_space_expands_ranges_and_derives_n_from_a_fixed_effective_batch():
    spec = parse(search={"sub_batch_size": {"min": 1, "max": 12}, "effective_batch_size": 12,
                         "num_live_blocks": {"min": 1, "max": 8}})
    space = SearchSpace(spec, shape_of("llama-tiny"))
    assert space.b_values == [1, 2, 4, 8, 12]
    assert space.k_values == [1, 2, 4]                 # llama-tiny has 4 layers: k=8 is k=4
    assert {c.batch for c in space.candidates} == {12}
    assert Candidate(12, 1, 4) in space.candidates and Candidate(4, 3, 2) in space.candidates
    assert all(c.b != 8 for c in space.candidates)     # 8 does not divide 12
    assert space.candidate({"sub_batch_size": 8, "effective_batch_size": 12, "num_live_blocks": 1}) is None


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
