"""A bad spec fails before any trial, naming the field and the fix."""

import subprocess
import sys

import pytest

from sltune.tuning.shape import shape_of
from sltune.tuning.space import Candidate, SearchSpace
from sltune.tuning.spec import TuningSpec

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
])
def test_bad_specs_name_the_field(overrides, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("*", r"\*")):
        parse(**overrides)


def test_kv_cache_is_swept_in_generation_only():
    shape = shape_of("llama-tiny")
    gen = {"workload": {"mode": "generate"}, "search": {"sub_batch_size": 2, "num_sub_batches": 2,
                                                        "num_live_blocks": 1}}
    both = SearchSpace(parse(**gen), shape)
    assert both.candidates == [Candidate(2, 2, 1, kv_cache="device"), Candidate(2, 2, 1, kv_cache="host")]
    assert both.neighbours_up(Candidate(2, 2, 1, kv_cache="host")) == [Candidate(2, 2, 1, kv_cache="device")]
    assert Candidate(2, 2, 1, kv_cache="device").dominates(Candidate(2, 2, 1, kv_cache="host"))
    one = SearchSpace(parse(workload=gen["workload"], search={**gen["search"], "kv_cache": "device"}), shape)
    assert one.candidates == [Candidate(2, 2, 1, kv_cache="device")] and one.describe()["kv_cache"] == ["device"]
    train = SearchSpace(parse(search=gen["search"]), shape)
    assert train.candidates == [Candidate(2, 2, 1)] and "kv_cache" not in train.distributions()


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
