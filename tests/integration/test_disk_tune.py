"""Disk as the tuner's third resource (issue 22): search.optimizer_offload [host, disk] and hardware.disk_limit.

A host limit only optimizer_offload disk satisfies is a config, not a refusal: a real tune picks disk and best.yaml
says so; `plan` shows the device, host and disk limits and names the one that binds; a disk limit too small for the
files refuses in one line naming it; and the spec's mistakes are one line each. The prior of a disk config is held
to a real trial: host memory within 10%, the files' bytes to the runtime's own counters.
"""

from __future__ import annotations

import functools
import json

import pytest
import yaml

from sltune.cli.main import main
from sltune.config import SpeedLoaderConfig
from sltune.profiling import run_trial
from sltune.profiling.schema import TrialSpec
from sltune.service.local import tune
from sltune.settings import Settings
from sltune.sizes import format_bytes
from sltune.tuning.cost.baseline import trial_baseline
from sltune.tuning.cost.prior import predict
from sltune.tuning.cost.setup import Setup
from sltune.tuning.report.plan_from_prior import plan_spec
from sltune.tuning.report.result import export_yaml
from sltune.tuning.cost.shape import shape_of
from sltune.tuning.space import Candidate, SearchSpace
from tests.support.specs import admitted_spec

# many small layers: AdamW's 8 bytes per parameter (260 MB) leave host memory under disk, the window only 3 layers'
MANY_LAYERS = {"model_type": "llama", "vocab_size": 512, "hidden_size": 256, "intermediate_size": 704,
               "num_hidden_layers": 40, "num_attention_heads": 4, "num_key_value_heads": 4,
               "max_position_embeddings": 64}


@functools.cache
def host_limit() -> int:
    """Under host a trial holds about 0.53 GB and the process, under disk about 0.39 GB and the process (measured):
    the limit sits 60 MB under the host config's prior with this process's trial baseline (which tune uses too),
    so the host config is over it even by a baseline 10% lower (what plan reads from the cache may be another
    process's measurement) and the disk trial stays about 80 MB under it."""
    s = admitted_spec(spec_with(None))
    recipe = Setup.of_spec(s, shape_of(s.model.source, s.model.dtype), trial_baseline("cpu", 1, "train", None))
    return predict(recipe, Candidate(1, 1, 1)).host - 60 * 10**6


SEARCH = {"sub_batch_size": [1], "num_sub_batches": [1], "num_live_blocks": [1], "optimizer_offload": ["host", "disk"],
          "trial_steps": 1, "trial_max_steps": 1, "trial_min_time_s": 0, "confirm_rounds": 0, "profile": False}


def spec_with(limit: int | None, **hardware) -> dict:
    return {"name": "disk-tune", "model": {"hf_config": MANY_LAYERS}, "workload": {"seq_len": 16},
            "hardware": {"device_memory_limit": "1GiB", "host_memory_limit": limit, "disk_limit": "2GiB",
                         **hardware}, "search": dict(SEARCH)}


def spec(**hardware) -> dict:
    return spec_with(host_limit(), **hardware)


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    data = tmp_path_factory.mktemp("disk-tune")
    settings = Settings(data_dir=data, max_trial_steps=1)
    result = tune(spec(), f"sqlite:///{data / 'jobs.db'}", settings=settings)
    return data, settings, result


def test_a_host_limit_only_disk_satisfies_picks_disk_and_best_yaml_trains_it(tuned, tmp_path, capsys):
    data, _, result = tuned
    assert result["status"] == "succeeded", result
    assert result["best"]["config"]["optimizer_offload"] == "disk"
    ran = [t for t in result["trials"] if t["status"] == "ok"]
    assert ran and all(t["config"].get("optimizer_offload") == "disk" for t in result["trials"])   # host: never run
    assert all(t["peak_host_bytes"] <= host_limit() for t in ran)
    # the prior of the disk config, with this process's trial baseline, against what its trial measured
    predicted, measured = result["predicted"]["prior_host_bytes"], result["best"]["peak_host_bytes"]
    assert predicted == pytest.approx(measured, rel=0.10), (predicted, measured)
    assert result["predicted"]["peak_disk_bytes"] > 2 * 8 * 32 * 10**6       # AdamW's state twice, 32M parameters
    assert not list((data / "offload").rglob("*.bin"))      # the trials' files went with them

    best = tmp_path / "best.yaml"
    export_yaml(admitted_spec(spec()), result, best)
    text = best.read_text()
    doc = yaml.safe_load(text)
    assert doc["optimizer_offload"] == "disk" and doc["offload_dir"] is None
    assert str(data) not in text                            # no folder of the tuning machine's
    assert doc["limits"]["disk_limit"] == 2 * 2**30 and doc["search_space"]["optimizer_offload"] == ["host", "disk"]
    with pytest.raises(ValueError, match=r"offload_dir: .*\(--offload-dir DIR\)"):
        SpeedLoaderConfig.from_yaml(best)
    assert main(["train", "--config", str(best), "--steps", "1", "--json"]) == 2
    err = capsys.readouterr().err
    assert "offload_dir" in err and "--offload-dir" in err and len(err.strip().splitlines()) == 1
    assert main(["train", "--config", str(best), "--steps", "1", "--json", "--offload-dir", str(tmp_path / "off")]) == 0
    trained = json.loads(capsys.readouterr().out)
    assert trained["config"]["optimizer_offload"] == "disk"
    assert trained["config"]["offload_dir"] == str(tmp_path / "off")
    # the flag over the file: a disk best.yaml trains with the optimizer in host memory, no folder asked for
    assert main(["train", "--config", str(best), "--steps", "1", "--json", "--optimizer-offload", "host"]) == 0
    assert json.loads(capsys.readouterr().out)["config"]["optimizer_offload"] == "host"


def test_plan_shows_the_three_limits_and_names_the_one_that_binds(tuned, tmp_path, capsys):
    _, settings, _ = tuned
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec()))
    assert main(["plan", str(path)]) == 0
    out = capsys.readouterr().out
    head = out.splitlines()[0]
    assert f"1 of 2 configs predicted to fit device 1.0 GiB, host {format_bytes(host_limit())} " \
           "(hardware.host_memory_limit), disk 2.0 GiB (hardware.disk_limit)" in head
    assert "b=1 N=1 k=1 optimizer_offload=disk: host " in out and ", disk 494.3 MiB  fits" in out
    assert "b=1 N=1 k=1: host " in out and ", disk 0 B  over host" in out
    assert "largest that fits: b=1 N=1 k=1 optimizer_offload=disk" in out and "binding limit: host" in out

    # disk binds: b=1 fits with the optimizer in host memory, b=2 neither there nor on a disk too small for it
    two = {**spec(), "search": {**SEARCH, "sub_batch_size": [1, 2]}}
    free = plan_spec({**two, "hardware": {}}, "spec", settings=settings)
    host = {c["config"]["sub_batch_size"]: c["peak_host_bytes"] for c in free["configs"]
            if "optimizer_offload" not in c["config"]}
    between = int((host[1] + host[2]) / 2 * 1.05)           # the margin's 5% on top of each prediction
    r = plan_spec({**two, "hardware": {"host_memory_limit": between, "disk_limit": "100MiB"}}, "spec",
                  settings=settings)
    assert [x["config"]["sub_batch_size"] for x in r["largest"]] == [1]
    assert r["largest"][0]["binding_limit"] == "disk+host" and r["refusal"] is None
    assert {c["config"]["sub_batch_size"]: c["over"] for c in r["configs"]
            if c["config"].get("optimizer_offload") == "disk"} == {1: ["disk"], 2: ["disk"]}
    assert r["limits"]["disk_limit"] == 100 * 2**20 and r["limits"]["disk_limit_from"] == "hardware.disk_limit"


def test_a_disk_limit_too_small_refuses_in_one_line_naming_it(tuned, tmp_path, capsys):
    _, settings, _ = tuned
    small = spec(disk_limit="100MiB")
    with pytest.raises(ValueError) as err:       # before any trial: the process counted, host is over without disk
        tune(small, f"sqlite:///{tmp_path / 'jobs.db'}", settings=settings)
    line = str(err.value)
    assert "\n" not in line and line.startswith("hardware.disk_limit 100.0 MiB is below the 494.3 MiB")
    assert "on disk" in line and "under optimizer_offload host it would need" in line
    path = tmp_path / "small.yaml"
    path.write_text(yaml.safe_dump(small))
    assert main(["plan", str(path)]) == 1
    out = capsys.readouterr().out
    assert "0 of 2 configs predicted to fit" in out and "  refused: hardware.disk_limit 100.0 MiB" in out
    # with room on disk the same host limit is a config: refused only when no offload choice fits
    path.write_text(yaml.safe_dump(spec()))
    assert main(["plan", str(path)]) == 0


def test_host_memory_only_disk_makes_room_for_is_a_config_not_a_refusal():
    """The spec check itself (no process counted): llama-2-7b's shape in bfloat16 needs about 118 GiB of host
    memory with AdamW in host memory, about 47 GiB with it on disk."""
    base = {"name": "7b", "model": {"preset": "llama-2-7b", "dtype": "bfloat16"}, "workload": {"seq_len": 128},
            "hardware": {"host_memory_limit": "60GiB"},
            "search": {"sub_batch_size": [1], "num_sub_batches": [1], "num_live_blocks": [1, 2]}}
    with pytest.raises(ValueError, match=r"hardware.host_memory_limit 60.0 GiB is below .* What would fit: "
                                         r"search.optimizer_offload \[host, disk\] \(the master and optimizer state "
                                         r"in files: 4\d\.\d GiB in host memory, 1\d\d\.\d GiB on disk\)"):
        admitted_spec(base)
    disk = admitted_spec({**base, "search": {**base["search"], "optimizer_offload": ["host", "disk"]}})
    assert {c.optimizer_offload for c in SearchSpace(disk, shape_of("llama-2-7b", "bfloat16")).candidates} == \
        {"host", "disk"}
    with pytest.raises(ValueError, match=r"^spec: hardware.disk_limit 100.0 GiB is below the 1\d\d\.\d GiB .* on "
                                         r"disk: the committed version's files"):
        admitted_spec({**base, "hardware": {"host_memory_limit": "60GiB", "disk_limit": "100GiB"},
                       "search": {**base["search"], "optimizer_offload": ["host", "disk"]}})


@pytest.mark.parametrize("search, hardware, message", [
    ({"optimizer_offload": "nvme"}, {}, "spec: search.optimizer_offload: 'nvme' is not where the optimizer's master "
                                        "and state can live; give host, disk or [host, disk]"),
    ({"optimizer_offload": []}, {}, "spec: search.optimizer_offload: [] is not a list of places; give host, disk or "
                                    "[host, disk]"),
    ({"optimizer_offload": ["host", 3]}, {}, "spec: search.optimizer_offload: 3 is not where"),
    ({}, {"disk_limit": "lots"}, "spec: hardware.disk_limit: "),
    ({}, {"disk_limit": "1GiB"}, "spec: hardware.disk_limit bounds the files of search.optimizer_offload or "
                                 "search.param_offload disk (or of DeepSpeed's nvme offload), which this spec does not "
                                 "try; add disk to search.optimizer_offload"),
    ({"optimizer_offload": "disk", "schedule": "resident"}, {}, "spec: search.optimizer_offload: the resident schedule "
                                                               "steps its optimizer on the device"),
])
def test_spec_mistakes_are_one_line_naming_the_field(search, hardware, message):
    data = {"model": {"preset": "llama-tiny"}, "hardware": hardware,
            "search": {"sub_batch_size": [1], "num_sub_batches": [1], "num_live_blocks": [1], **search}}
    with pytest.raises(ValueError) as err:
        admitted_spec(data)
    assert str(err.value).startswith(message) and "\n" not in str(err.value), str(err.value)


def test_generation_refuses_disk_and_old_configs_read_as_host():
    with pytest.raises(ValueError, match="search.optimizer_offload: disk holds a training optimizer's state"):
        admitted_spec({"model": {"preset": "llama-tiny"}, "workload": {"mode": "generate"},
                       "search": {"optimizer_offload": ["host", "disk"]}})
    old = {"sub_batch_size": 2, "num_sub_batches": 4, "num_live_blocks": 1, "activations": "recompute"}
    assert Candidate.from_knobs(old).optimizer_offload == "host" and Candidate.from_knobs(old).knobs() == old
    disk = Candidate(2, 4, 1, optimizer_offload="disk")
    assert Candidate.from_knobs({**disk.knobs(), "schedule": "speedloader"}) == disk
    assert str(disk) == "b=2 N=4 k=1 optimizer_offload=disk"
    one = admitted_spec({"model": {"preset": "llama-tiny"}, "search": {"num_live_blocks": [1]}})
    both = admitted_spec({"model": {"preset": "llama-tiny"},
                          "search": {"num_live_blocks": [1], "optimizer_offload": ["disk", "host", "disk"]}})
    shape = shape_of("llama-tiny")
    s1, s2 = SearchSpace(one, shape), SearchSpace(both, shape)
    assert "optimizer_offload" not in s1.param_names and s2.distributions()["optimizer_offload"].choices == (
        "host", "disk")
    assert both.search.optimizer_offload == ["host", "disk"] and len(s2.candidates) == 2 * len(s1.candidates)
    assert all(s2.candidate(s2.params(c)) == c for c in s2.candidates)
    host = Candidate(2, 4, 1)
    assert host.dominates(disk) and not disk.dominates(host)
    assert s2.neighbours_up(Candidate(1, 1, 1, optimizer_offload="disk"))[-1] == Candidate(1, 1, 1)


def test_the_prior_of_a_disk_trial_is_what_the_trial_holds(tmp_path):
    """llama-tiny, one real trial under disk: its host peak within 10% of the prior, and the files it moves per
    step (the runtime's counters) half the predicted disk footprint: the committed version and the one a step
    writes beside it."""
    trial = TrialSpec(model="llama-tiny", sub_batch_size=2, num_sub_batches=2, num_live_blocks=1, seq_len=32, steps=2,
                      min_time_s=0.0, max_steps=2, remeasure=0, profile=False, optimizer_offload="disk",
                      offload_dir=str(tmp_path / "off"))
    baseline = trial_baseline(trial.device, trial.world_size, trial.mode, trial.cpu_threads)
    recipe = Setup.of_trial(trial, shape_of(trial.model, trial.dtype), baseline)
    prior = predict(recipe, Candidate(2, 2, 1, optimizer_offload="disk"))
    hosted = predict(recipe, Candidate(2, 2, 1))
    assert hosted.host == prior.host    # the trial's recipe says disk: either place says disk
    result = run_trial(trial)
    assert result.status == "ok", result.error
    assert prior.host == pytest.approx(result.peak_host_bytes, rel=0.10), (prior.host_terms, result.peak_host_bytes)
    assert result.io.disk_write_bytes == result.io.disk_read_bytes == prior.disk // 2 > 0, (prior.disk_terms,
                                                                                             result.io)
    names = dict(prior.host_terms)
    assert "AdamW's two moments in float32" not in names and names["the disk tier's window (3 blocks' master and " \
                                                                   "state)"] > 0


def test_plan_takes_a_disk_limit_for_a_spec_and_refuses_it_where_disk_is_not_planned(tuned, tmp_path, capsys):
    _, settings, result = tuned
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec()))
    assert main(["plan", str(path), "--disk-limit", "100MiB"]) == 1         # the flag over the spec's 2 GiB
    out = capsys.readouterr().out
    assert "disk 100.0 MiB (--disk-limit, a what-if: this machine has " in out.splitlines()[0] and "over disk" in out
    host_only = {**spec(), "hardware": {k: v for k, v in spec()["hardware"].items() if k != "disk_limit"},
                 "search": {**SEARCH, "optimizer_offload": "host"}}
    path.write_text(yaml.safe_dump(host_only))
    assert main(["plan", str(path), "--disk-limit", "1GiB"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "does not try; add disk to search.optimizer_offload" in err
    best = tmp_path / "best.yaml"
    export_yaml(admitted_spec(spec()), result, best)
    assert main(["plan", str(best), "--disk-limit", "1GiB"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.endswith("give the tuning spec (sltune plan SPEC.yaml --disk-limit ...)")


def test_a_job_taken_up_again_removes_the_optimizer_files_a_killed_holder_left(tuned):
    data, settings, _ = tuned
    left = settings.offload_root() / "left-behind" / "trial-99"     # a number no trial of this job reaches
    left.mkdir(parents=True)
    (left / "block-0.bin").write_bytes(b"\0" * 4096)
    assert (settings.offload_root() / "left-behind").exists()
    r = tune({**spec(), "name": "left-behind"}, f"sqlite:///{data / 'jobs.db'}", job_id="left-behind",
             settings=settings)
    assert r["status"] == "succeeded", r
    assert not (settings.offload_root() / "left-behind").exists()
