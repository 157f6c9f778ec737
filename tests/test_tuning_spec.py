"""A bad spec fails before any trial, naming the field and the fix."""

import subprocess
import sys

import pytest

from sltune.tuning.fit import MODELS, variables
from sltune.tuning.shape import shape_of
from sltune.tuning.space import Candidate, SearchSpace
from sltune.tuning.spec import TuningSpec
from sltune.tuning.state import SearchState

BASE = {"name": "t", "model": {"preset": "llama-tiny"}, "workload": {"seq_len": 32}}


def parse(**overrides):
    data = {**BASE, **overrides}
    return TuningSpec.parse(data)


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
])
def test_bad_specs_name_the_field(overrides, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("*", r"\*")):
        parse(**overrides)


def test_kv_cache_is_swept_in_generation_only():
    shape = shape_of("llama-tiny")
    gen = {"workload": {"mode": "generate"}, "search": {"sub_batch_size": 2, "num_sub_batches": 2,
                                                        "num_live_blocks": 1, "weights_on_device": 0}}
    host, device = (Candidate(2, 2, 1, kv_cache=kv, w=0.0) for kv in ("host", "device"))
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
    assert space.candidates == [Candidate(2, 2, 1, kv_cache="host", w=w) for w in (0.0, 0.5, 1.0)]
    assert space.describe()["weights_on_device"] == [0.0, 0.5, 1.0]
    half = Candidate(2, 2, 1, kv_cache="host", w=0.5)
    assert str(half) == "b=2 N=2 k=1 kv_cache=host w=0.5" and half.knobs()["weights_on_device"] == 0.5
    assert Candidate.from_knobs(half.knobs()) == half == space.candidate(space.params(half))    # Optuna's params
    assert space.neighbours_up(half) == [Candidate(2, 2, 1, kv_cache="host", w=1.0)]
    assert space.distributions()["weights_on_device"].choices == (0.0, 0.5, 1.0)
    # keeping more weights needs at least as much device memory; a config without the knob keeps none
    assert Candidate(2, 2, 1, w=1.0).dominates(Candidate(2, 2, 1, w=0.5))
    assert not Candidate(2, 2, 1, w=0.5).dominates(Candidate(2, 2, 1, w=1.0))
    assert Candidate(2, 2, 1, w=0.5).dominates(Candidate(2, 2, 1)) and not Candidate(2, 2, 1).dominates(half)
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
        return variables(Candidate(1, 1, k, kv_cache="host", w=share), shape, 24)["W"]

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
    assert state.predict(Candidate(1, 1, 1, kv_cache="host", w=1.0)).over == ["device"]
    assert state.predict(Candidate(1, 1, 1, kv_cache="host", w=0.5)).fits       # 632064 bytes at least
    # one group of all 4 layers does not fit in half, and streamed in it lands beside the kept embedding and head
    assert state.predict(Candidate(1, 1, 4, kv_cache="host", w=0.5)).over == ["device"]
    assert state.predict(Candidate(1, 1, 4, kv_cache="host", w=0.0)).fits


def test_a_limit_below_what_the_smallest_config_needs_says_that_minimum():
    shape = shape_of("llama-tiny")
    need = shape.min_device_bytes("train")
    with pytest.raises(ValueError, match=rf"hardware.device_memory_limit .* below the .*\({need} bytes\)"):
        parse(hardware={"device_memory_limit": need - 1})
    parse(hardware={"device_memory_limit": need})
    need_host = shape.min_host_bytes("train")
    with pytest.raises(ValueError, match=rf"host_memory_limit .*\({need_host} bytes\).*AdamW"):
        parse(hardware={"host_memory_limit": need_host - 1})


def test_cli_refuses_a_bad_spec_before_any_trial(tmp_path):
    spec = tmp_path / "bad.yaml"
    spec.write_text("name: x\nmodel: {preset: llama-tiny}\nsearch: {max_trails: 3}\n")
    db = tmp_path / "jobs.db"
    out = subprocess.run([sys.executable, "-m", "sltune", "tune", str(spec), "--db", f"sqlite:///{db}"],
                         capture_output=True, text=True, timeout=120)
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
