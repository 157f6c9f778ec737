"""The prior (sltune.tuning.cost.prior) with the weights on disk (param_offload disk): the host floor falls to a
window of the weights and gradients, their files and a step's traffic on disk instead, over one rank or two; the
runtime's window constants are the prior's."""

from __future__ import annotations

from sltune.runtime.disk.layout import padded
from sltune.tuning.cost.prior import GRAD_UNITS, SPARE, STAGED, predict
from sltune.tuning.cost.setup import Setup
from sltune.tuning.cost.shape import shape_of
from sltune.tuning.space import Candidate
from tests.support.offload_specs import BOTH, GiB, HOST, OPTIMIZER, WEIGHTS, spec


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
