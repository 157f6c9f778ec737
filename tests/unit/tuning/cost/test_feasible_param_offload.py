"""The weights on disk in a refusal's answer (sltune.tuning.cost.feasible, search.param_offload): named under what
would fit where host memory is short, not where only the disk is; the free space reads as a place."""

from __future__ import annotations

import re

from sltune.settings import Settings
from sltune.tuning.cost import feasible
from sltune.tuning.cost.feasible import FreeSpace, Limit
from sltune.tuning.cost.setup import Setup
from sltune.tuning.cost.shape import shape_of
from sltune.tuning.report.plan_from_prior import plan_spec
from sltune.tuning.space import SearchSpace
from tests.support.offload_specs import GiB, SEVEN_B, seven_b
from tests.support.specs import admitted_spec


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
