"""The prior of a wrapped backend's config (sltune.tuning.cost.wrapped): DeepSpeed's and FSDP's peaks from the
model's shape, and DeepSpeed's nvme files held to the disk limit."""

import pytest

from sltune.tuning.cost.prior import predict
from sltune.tuning.cost.setup import Setup
from sltune.tuning.cost.shape import shape_of
from sltune.tuning.spec import TuningSpec
from tests.support.backend_specs import SHAPE, ds, fsdp, parse
from tests.support.deepspeed import needs_deepspeed
from tests.support.specs import admitted_spec as admitted


@pytest.mark.parametrize("stage, opt, param", [(2, "none", "none"), (2, "cpu", "none"), (3, "none", "none"),
                                               (3, "cpu", "none"), (3, "cpu", "cpu")])
def test_the_deepspeed_prior_holds_what_its_trials_allocate(stage, opt, param):
    """float16 with AdamW over 2 ranks: the terms bench/wrapped_anatomy.py found in DeepSpeed's trials. Held all step:
    the weights in dtype (a copy each at ZeRO-2, a 1/W shard at ZeRO-3) and, unless offloaded, the float32 master and
    Adam's state (12 bytes, 1/W); at the step the float32 gradient partitions, the dtype ones flattened for that copy
    and ZeRO-2's averaged dtype ones. With the optimizer offloaded, the backward's end holds the largest parameter's
    gradient whole in dtype and a float64 copy of its partition (the gradient norm DeepSpeed takes before offloading
    it)."""
    from sltune.tuning.cost.wrapped import model_states

    spec = parse({"backend": "deepspeed"}, model={"preset": "llama-tiny", "dtype": "float16"},
                 hardware={"world_size": 2})
    shape = shape_of("llama-tiny", "float16")
    recipe, c = Setup.of_spec(spec, shape), ds(1, 1, stage, opt, param)
    count, world = shape.param_bytes // 2, 2
    largest = max(shape.layer_numels + shape.embed_numels + shape.head_numels + shape.tied_numels)
    weights = 2 * count // world if stage == 3 else 2 * count
    device, host = model_states(recipe, c)
    got = dict(device)
    if opt == "cpu":
        assert got["the largest parameter's gradient"] == 2 * largest
        assert got["its partition in float64 for the gradient norm"] == 8 * -(-largest // world)
        assert sum(n for what, n in host if "offloaded" in what) == 16 * count + (2 * count if param == "cpu" else 0)
    else:
        assert got["float32 master partitions (ZeRO shards)"] == 4 * count // world
        assert got["float32 gradient partitions (ZeRO shards)"] == 4 * count // world
        assert ("float16 gradient partitions (ZeRO shards)" in got) == (stage == 2)
        assert got["float16 gradient partitions flattened for that copy"] == 2 * count // world
    assert got.get("the weights in float16 (ZeRO-3 shards)" if stage == 3 else
                   "the weights in float16 (every rank a copy)", 0) == (0 if param == "cpu" else weights)
    # the prior's device peak is one moment's: what is held, and the fullest of the backward, its end and the step
    prior = predict(recipe, c).device
    held = weights * (param != "cpu") + (12 * count // world if opt == "none" else 0)
    assert prior >= held + (2 * largest + 8 * -(-largest // world) if opt == "cpu" else 4 * count // world)


def test_the_fsdp_prior_is_its_shards_and_gathered_weights_from_the_shape():
    spec = parse({"backend": "fsdp"}, hardware={"world_size": 2})
    recipe = Setup.of_spec(spec, SHAPE)
    count = SHAPE.param_bytes // SHAPE.itemsize
    on_device = dict(predict(recipe, fsdp(1, 1)).device_terms)
    assert on_device["float32 weight shards"] == 4 * count // 2                   # 1/W each rank
    offloaded = predict(recipe, fsdp(1, 1, cpu=True))
    assert "float32 weight shards" not in dict(offloaded.device_terms)
    assert dict(offloaded.host_terms)["float32 weight shards (cpu_offload)"] == 4 * count    # every rank's
    # the step holds the most at b=1; from some b on, the backward's activations do, and grow with it
    one, four, many = (predict(recipe, fsdp(b, 1)).device for b in (1, 4, 64))
    assert one == four < many


@needs_deepspeed
def test_nvme_files_are_disk_held_to_the_disk_limit(monkeypatch):
    """DeepSpeed's nvme offload writes its partitions to files: the prior counts them as disk (its estimators'
    bytes: the float32 master, Adam's two moments and the float32 gradients, 16 per parameter, and ZeRO-3's weight
    shards in dtype), and a spec whose disk limit is below them is refused naming hardware.disk_limit."""
    from sltune import backend_knobs as knobs

    monkeypatch.setattr(knobs, "libaio_found", lambda: True)
    base = {"name": "nvme", "model": {"preset": "llama-tiny"}, "workload": {"seq_len": 32},
            "search": {"backend": "deepspeed", "sub_batch_size": [1], "num_sub_batches": [1],
                       "deepspeed": {"zero_stage": 3, "offload_optimizer": "nvme", "offload_param": "nvme"}}}
    recipe = Setup.of_spec(TuningSpec.parse(base), SHAPE)
    count = SHAPE.param_bytes // SHAPE.itemsize
    prior = predict(recipe, ds(1, 1, stage=3, opt="nvme", param="nvme"))
    assert prior.disk == (4 + 8 + 4 + SHAPE.itemsize) * count, prior.disk_terms
    assert predict(recipe, ds(1, 1, stage=3, opt="cpu", param="cpu")).disk == 0
    with pytest.raises(ValueError, match=r"hardware\.disk_limit 1\.0 MiB is below the .* the smallest config "
                                         r"\(deepspeed b=1 N=1 zero_stage=3 offload_optimizer=nvme "
                                         r"offload_param=nvme\) is predicted to need on disk: float32 master"):
        admitted({**base, "hardware": {"disk_limit": "1MiB"}})
    admitted({**base, "hardware": {"disk_limit": f"{prior.disk * 2}B"}})
