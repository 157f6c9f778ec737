"""`sltune plan SPEC.yaml` (sltune.tuning.report.plan_from_prior): every config of every backend predicted before
any trial and the largest that fits listed, a 7B under 17 GiB of host memory with the weights on disk, and the disk
limit as a what-if or held to the free space."""

from __future__ import annotations

import re

import pytest
import yaml

from sltune.settings import Settings
from sltune.tuning.report.plan_from_prior import plan_spec
from tests.support.cli import sltune
from tests.support.deepspeed import needs_deepspeed
from tests.support.offload_specs import BOTH, GiB, seven_b
from tests.support.rates import rates_for


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


@pytest.mark.parametrize("backends", [
    ["speedloader", "fsdp"], pytest.param(["speedloader", "deepspeed", "fsdp"], marks=needs_deepspeed)])
def test_plan_predicts_every_backend_s_step_and_picks_across_them(backends):
    """Given a machine's rates, every config of every backend gets a step time (a wrapped backend's from its own
    schedule), and the pick is the fitting config predicted fastest, whichever backend it is."""
    spec = {"model": {"preset": "llama-tiny"}, "workload": {"seq_len": 32},
            "search": {"backend": backends, "sub_batch_size": [1, 2], "num_sub_batches": [1, 2],
                       "num_live_blocks": [1, 2]}}
    out = plan_spec(spec, "spec.yaml", rates=rates_for(seq=32), rates_from="test")
    assert out["rates"]["missing"] is None
    for row in out["configs"]:
        assert row["predicted_step_s"] > 0, row["config"]
        assert row["predicted_tokens_per_s"] == pytest.approx(
            row["config"]["sub_batch_size"] * row["config"]["num_sub_batches"] * 32 / row["predicted_step_s"])
    assert {row["config"].get("backend") or "speedloader" for row in out["configs"]} == set(backends)
    best = max((row for row in out["configs"] if row["fits"]), key=lambda row: row["predicted_tokens_per_s"])
    assert out["pick"]["config"] == best["config"]


def test_plan_picks_no_config_whose_trial_would_outlast_the_trial_timeout():
    """plan's pick is what the guided search would measure first: a config predicted to outlast
    search.trial_timeout_s would only time out, so it is counted apart (too_slow) and never picked."""
    spec = {"model": {"preset": "llama-tiny"}, "workload": {"seq_len": 32},
            "search": {"sub_batch_size": [1, 2, 4], "num_sub_batches": [1, 2], "num_live_blocks": [1, 2]}}
    free = plan_spec(spec, "spec.yaml", rates=rates_for(seq=32), rates_from="test")
    steps = sorted(row["predicted_step_s"] for row in free["configs"] if row["fits"])
    assert free["too_slow"] == 0 and free["pick"]["config"]["sub_batch_size"] == 4
    # a timeout between the quickest configs' trials and the slowest ones': the pick is among the quick ones
    timeout = steps[len(steps) // 2] * 5 * 1.2       # 2 timed steps, a warm-up, a profiled one, one more; 20% error
    bound = plan_spec({**spec, "search": {**spec["search"], "trial_timeout_s": timeout}}, "spec.yaml",
                      rates=rates_for(seq=32), rates_from="test")
    pick = next(row for row in bound["configs"] if row["config"] == bound["pick"]["config"])
    assert 0 < bound["too_slow"] < bound["fitting"]
    assert pick["predicted_step_s"] * 5 * 1.2 <= timeout < free["pick"]["predicted_step_s"] * 5 * 1.2
    none = plan_spec({**spec, "search": {**spec["search"], "trial_timeout_s": steps[0] * 5}}, "spec.yaml",
                     rates=rates_for(seq=32), rates_from="test")
    assert none["pick"] is None and none["too_slow"] == none["fitting"]


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
    --disk-limit is a what-if, which stands (test_plan_s_disk_limit_is_a_what_if_that_stands..., below)."""
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


def test_plan_s_disk_limit_is_a_what_if_that_stands_and_what_would_fit_names_one_version(tmp_path, monkeypatch):
    """`plan --disk-limit 1TiB` plans with 1 TiB whatever this machine has free (a 7B's weights and optimizer on disk
    were refused on a 70 GiB disk), saying what is free here beside it; under a limit only one version of the disk
    tier's files fits, what would fit names --disk-versions 1."""
    from sltune.tuning.cost import feasible

    monkeypatch.setattr(feasible, "free_bytes", lambda folder: 10 * 2**30)
    spec = {"name": "7b", "model": {"preset": "llama-2-7b", "dtype": "bfloat16"}, "workload": {"seq_len": 2048},
            "hardware": {"device": "cuda", "device_memory_limit": "24GiB", "host_memory_limit": "64GiB"},
            "search": {"sub_batch_size": [1], "num_sub_batches": [4], "num_live_blocks": [1],
                       "optimizer_offload": "disk", "param_offload": "disk"}}
    settings = Settings(data_dir=tmp_path)
    r = plan_spec(spec, "7b.yaml", settings=settings, disk_limit="1TiB", disk_flag="--disk-limit")
    assert r["fitting"] == 1 and r["refusal"] is None and r["limits"]["disk_limit"] == 2**40
    assert r["limits"]["disk_limit_note"] == (f"--disk-limit, a what-if: this machine has 10.0 GiB free in "
                                              f"{tmp_path / 'offload'}")
    need = r["configs"][0]["peak_disk_bytes"]
    one = plan_spec(spec, "7b.yaml", settings=settings, disk_limit=need, disk_versions=1)["configs"][0]
    r = plan_spec(spec, "7b.yaml", settings=settings, disk_limit=(need + one["peak_disk_bytes"]) // 2,
                  disk_flag="--disk-limit")
    assert r["fitting"] == 0 and r["refusal"].startswith("--disk-limit ")
    assert "What would fit: --disk-versions 1 (one version of the disk tier's files: about half the disk)" in \
        r["refusal"]
    # the spec's own disk limit is held to the free space, as tune holds it
    held = plan_spec({**spec, "hardware": {**spec["hardware"], "disk_limit": "1TiB"}}, "7b.yaml", settings=settings)
    assert held["limits"]["disk_limit"] == 10 * 2**30 and held["fitting"] == 0
