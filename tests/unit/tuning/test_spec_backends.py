"""The spec's backends (sltune.tuning.spec, issue #33): search.backend and its sections, their defaults, and what
a backend cannot run refused naming the field and the fix."""

import re

import pytest

from sltune.tuning.spec import TuningSpec
from tests.support.backend_specs import parse


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
