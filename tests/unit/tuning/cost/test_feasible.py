"""What a spec that cannot fit is told (sltune.tuning.cost.feasible).

A refusal names, in one answer, every limit the closest config is over (device, host and disk) with what it needs
there, so raising them as it says is not refused again for another resource; the disk's free space, when it
applies over a larger hardware.disk_limit, says so. A limit is held to the smallest config's prior, term by term; a
host limit to every rank together; a backend none of whose configs fit is named.
"""

from __future__ import annotations

import re

import pytest
import yaml

from sltune.cli.main import main
from sltune.service.validation import check
from sltune.settings import Settings
from sltune.tuning.cost.feasible import free_bytes
from sltune.tuning.cost.prior import predict
from sltune.tuning.cost.setup import Setup
from sltune.tuning.cost.shape import shape_of
from sltune.tuning.report.plan_from_prior import plan_spec
from sltune.tuning.space import Candidate, SearchSpace
from sltune.tuning.spec import TuningSpec
from tests.support.backend_specs import KNOBS, SHAPE
from tests.support.cli import sltune
from tests.support.specs import admitted_spec, admitted_spec as admitted, parse

# llama-2-7b in bfloat16 with AdamW: about 118 GiB of host memory with the optimizer in host memory; about 47 GiB
# of host memory and 151 GiB of disk with it in files
SEVEN_B = {"name": "7b-disk", "model": {"preset": "llama-2-7b", "dtype": "bfloat16"}, "workload": {"seq_len": 128},
           "hardware": {"host_memory_limit": "20GiB", "disk_limit": "1GiB"},
           "search": {"sub_batch_size": [1], "num_sub_batches": [1], "num_live_blocks": [1, 2],
                      "optimizer_offload": ["host", "disk"]}}
LIMIT = r"(hardware\.\w+) [\d.]+ \w?i?B is below the [\d.]+ \w?i?B \((\d+) bytes\)"


def needs(refusal: str) -> dict[str, int]:
    """Each limit the refusal says is too low, with the bytes it says that limit needs."""
    return {name: int(n) for name, n in re.findall(LIMIT, refusal.split(" under ")[0])}


def with_hardware(spec: dict, **hardware) -> dict:
    return {**spec, "hardware": {**spec["hardware"], **hardware}}


def test_plan_names_the_host_and_the_disk_limit_together_and_following_it_is_not_refused_again(tmp_path):
    """The issue: `plan` said raise the host limit to 46.7 GiB; raised, the spec was refused again for disk."""
    path = tmp_path / "7b.yaml"
    path.write_text(yaml.safe_dump(SEVEN_B))
    out = sltune("plan", str(path), env={"SLTUNE_DATA_DIR": str(tmp_path / "data")})
    assert out.returncode == 1, out.stderr
    refusal = next(line for line in out.stdout.splitlines() if line.startswith("  refused: "))
    said = needs(refusal)
    assert set(said) == {"hardware.host_memory_limit", "hardware.disk_limit"}, refusal
    assert refusal.startswith("  refused: hardware.host_memory_limit 20.0 GiB is below the 4")
    assert "optimizer_offload=disk) is predicted to need in host memory: " in refusal
    assert "hardware.disk_limit 1.0 GiB is below the 150.6 GiB" in refusal and "it needs on disk: " in refusal
    # the other way: the optimizer in host memory needs more host memory and no disk
    # (about 115 GiB of the model's terms, and what a trial process holds: plan reads the last figure measured on this
    # machine, else an idle process's, 0.3 to 1.5 GiB as the process's imports go)
    assert re.search(r"under optimizer_offload host it would need 11[5-7]\.\d GiB", refusal), refusal
    # the weights on disk too (search.param_offload, which the spec does not try) fit the host limit: named first,
    # with the disk they take
    assert "What would fit: no change of dtype, precision or optimizer; search.param_offload [host, disk] (the " \
           "weights in files too" in refusal and "with a hardware.disk_limit of at least 175.7 GiB" in refusal
    assert "; or a hardware.host_memory_limit of at least 4" in refusal and \
           " and a hardware.disk_limit of at least 150.6 GiB" in refusal
    assert "a the " not in refusal

    # followed, both limits raised as said: the spec's own check admits it (plan counts the process a trial runs
    # in, which the spec's check leaves out, so plan's bytes cover it)
    admitted_spec(with_hardware(SEVEN_B, host_memory_limit=said["hardware.host_memory_limit"],
                                disk_limit=said["hardware.disk_limit"]))
    # half followed, the host limit alone: refused for the disk, which the answer had named already
    half = with_hardware(SEVEN_B, host_memory_limit=said["hardware.host_memory_limit"])
    with pytest.raises(ValueError) as again:
        admitted_spec(half)
    assert set(needs(str(again.value))) == {"hardware.disk_limit"}
    assert needs(str(again.value))["hardware.disk_limit"] == said["hardware.disk_limit"]


def test_tune_and_the_servers_check_give_the_same_whole_answer(tmp_path, capsys):
    path = tmp_path / "7b.yaml"
    path.write_text(yaml.safe_dump(SEVEN_B))
    assert main(["tune", str(path), "--db", f"sqlite:///{tmp_path / 'jobs.db'}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("sltune tune: error: ")
    assert set(needs(err)) == {"hardware.host_memory_limit", "hardware.disk_limit"}, err
    verdict = check(SEVEN_B, Settings(data_dir=tmp_path / "data"))
    said = " ".join(msg for _, msg in verdict.errors)
    assert set(needs(said)) == {"hardware.host_memory_limit", "hardware.disk_limit"}, said


def test_a_device_and_a_host_limit_both_too_small_are_named_together():
    """llama-tiny: the smallest config over both; each raised as said, the spec is admitted."""
    spec = {"name": "t", "model": {"preset": "llama-tiny"}, "workload": {"seq_len": 32},
            "hardware": {"device_memory_limit": 1024, "host_memory_limit": 1024},
            "search": {"sub_batch_size": [1], "num_sub_batches": [1], "num_live_blocks": [1]}}
    with pytest.raises(ValueError) as refused:
        admitted_spec(spec)
    said = needs(str(refused.value))
    assert set(said) == {"hardware.device_memory_limit", "hardware.host_memory_limit"}, str(refused.value)
    assert "\n" not in str(refused.value)
    admitted_spec(with_hardware(spec, device_memory_limit=said["hardware.device_memory_limit"],
                                host_memory_limit=said["hardware.host_memory_limit"]))


def test_the_free_space_over_a_larger_disk_limit_says_so_and_the_disk_wording_reads(tmp_path):
    """A hardware.disk_limit of 100 TiB on a disk with less free: plan's limits and its refusal say the free space
    applies, and what would fit reads "at least ... free in DIR", not "a the free space in DIR of at least"."""
    spec = {"name": "70b", "model": {"preset": "llama-2-70b", "dtype": "bfloat16"}, "workload": {"seq_len": 128},
            "hardware": {"host_memory_limit": "2TiB", "disk_limit": "100TiB"},
            "search": {"sub_batch_size": [1], "num_sub_batches": [1], "num_live_blocks": [1],
                       "optimizer_offload": "disk"}}
    data = tmp_path / "data"
    r = plan_spec(spec, "70b.yaml", settings=Settings(data_dir=data))
    root = data / "offload"
    free = r["limits"]["disk_limit"]        # the free space then: other processes write to this disk meanwhile
    assert abs(free - free_bytes(root)) < 2**30 and free < 100 * 2**40
    assert r["limits"]["disk_limit_from"] == f"the free space in {root}"
    # the plan says so in the words of the issue: the limit asked, the free space, and that it plans with that
    assert re.fullmatch(rf"hardware\.disk_limit is 100\.0 TiB but only [\d.]+ GiB is free in {re.escape(str(root))}: "
                        r"planning with [\d.]+ GiB", r["limits"]["disk_limit_note"]), r["limits"]["disk_limit_note"]
    path = tmp_path / "70b.yaml"
    path.write_text(yaml.safe_dump(spec))
    out = sltune("plan", str(path), env={"SLTUNE_DATA_DIR": str(data)})
    head = out.stdout.splitlines()[0]
    assert re.search(rf"disk [\d.]+ GiB \(hardware\.disk_limit is 100\.0 TiB but only [\d.]+ GiB is free in "
                     rf"{re.escape(str(root))}: planning with [\d.]+ GiB\)", head), head
    need = next(c["peak_disk_bytes"] for c in r["configs"])
    if free >= need:
        pytest.skip(f"{free} bytes free: the 70B's {need} bytes of files fit, nothing to refuse")
    assert r["refusal"].startswith(f"the {free / 2**30:.1f} GiB free in {root} (hardware.disk_limit 100.0 TiB is "
                                   "more than is free there: the free space applies) is below the 1.5 TiB")
    assert f"What would fit: no change of dtype, precision or optimizer; at least 1.5 TiB free in {root}" in \
        r["refusal"] or f"; or at least 1.5 TiB free in {root}" in r["refusal"]
    assert "a the " not in r["refusal"] and "a the " not in out.stdout


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


def test_a_host_limit_holds_every_rank_together_and_more_ranks_do_not_make_room():
    one = admitted_spec({"name": "w", "model": {"preset": "llama-small"}})
    two = admitted_spec({"name": "w", "model": {"preset": "llama-small"}, "hardware": {"world_size": 2}})
    shape = shape_of("llama-small")
    c = Candidate(1, 1, 1)
    p1, p2 = (predict(Setup.of_spec(s, shape), c) for s in (one, two))
    terms1, terms2 = dict(p1.host_terms), dict(p2.host_terms)
    # the parameters' terms are sharded: all ranks together hold them once; each rank runs its own batch
    assert terms2["AdamW's two moments in float32"] >= terms1["AdamW's two moments in float32"]
    assert p2.host > p1.host
    with pytest.raises(ValueError, match="all ranks together") as refused:
        admitted_spec({"name": "w", "model": {"preset": "llama-small"},
                       "hardware": {"world_size": 2, "host_memory_limit": p1.host // 2}})
    assert "world_size" not in str(refused.value).split("What would fit")[1]


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
