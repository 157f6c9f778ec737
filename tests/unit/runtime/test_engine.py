"""SpeedLoaderEngine (sltune.runtime.engine): one train_step equals one step of plain PyTorch on the whole batch, for
every family and every schedule; evaluate trains nothing; what the engine refuses to build or run."""

import pytest
import torch

from sltune import SpeedLoaderConfig, SpeedLoaderEngine
from sltune.models import build
from tests.support.reference import adamw, plain_training, snapshot
from tests.support.runtime import FAMILIES, batch, batches, check, engine, run_engine

SCHEDULES = ["speedloader", "canonical", "resident"]


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("preset", FAMILIES)
def test_one_step_matches_plain_pytorch(preset, schedule):
    check(*run_engine(preset, [batch(8, 16)], sub_batch_size=2, num_sub_batches=4, num_live_blocks=3,
                      schedule=schedule))


@pytest.mark.parametrize("knobs", [
    dict(sub_batch_size=2, num_sub_batches=3, num_live_blocks=3),    # 4 layers: groups of 3 and 1
    dict(sub_batch_size=2, num_sub_batches=3, num_live_blocks=9),    # more live blocks than layers
    dict(sub_batch_size=6, num_sub_batches=1, num_live_blocks=2),    # one sub-batch
    dict(sub_batch_size=1, num_sub_batches=6, num_live_blocks=1),    # sub-batches of one row
], ids=["k-not-dividing", "k-above-layers", "one-sub-batch", "rows-of-one"])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_awkward_shapes(knobs, schedule):
    check(*run_engine("llama-tiny", [batch(6, 12)], schedule=schedule, **knobs))


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("preset", ["llama-tiny", "gpt2-tiny"])
def test_two_adamw_steps(preset, schedule):
    check(*run_engine(preset, [batch(8, 16, seed=1), batch(8, 16, seed=2)], sub_batch_size=2,
                      num_sub_batches=4, num_live_blocks=2, schedule=schedule))


@pytest.mark.parametrize("preset", ["llama-tiny", "qwen2-tiny", "opt-tiny"])
def test_left_padding_and_ignored_labels(preset):
    """Padded rows: the mask reaches every layer as the library builds it; pad labels are ignored."""
    ids = batch(4, 12)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    mask[3, :2] = 0
    check(*run_engine(preset, [ids], masks=[mask], sub_batch_size=1, num_sub_batches=4, num_live_blocks=2))


def test_dropout_is_replayed_in_recompute():
    """With dropout on and one sub-batch the engine draws random numbers in plain PyTorch's order, so
    equal results prove the recompute replays the forward's dropout masks."""
    cfg = {"model_type": "gpt2", "vocab_size": 512, "n_embd": 64, "n_layer": 4, "n_head": 4,
           "resid_pdrop": 0.2, "embd_pdrop": 0.2, "attn_pdrop": 0.2}
    model = build(cfg, seed=0).train()
    init = snapshot(model)
    torch.manual_seed(123)
    ref_model, ref_losses, ref_grads = plain_training(model, [batch(4, 16)])
    engine = SpeedLoaderEngine(model, SpeedLoaderConfig(sub_batch_size=4, num_sub_batches=1, num_live_blocks=2),
                               optimizer=adamw)
    torch.manual_seed(123)
    res = engine.train_step(batch(4, 16))
    check(init, engine, [res], ref_model, ref_losses, ref_grads)


def test_frozen_parameters_are_not_updated():
    model = build("llama-tiny")
    model.model.embed_tokens.weight.requires_grad_(False)
    model.model.layers[0].requires_grad_(False)
    init = snapshot(model)
    engine = SpeedLoaderEngine(model, SpeedLoaderConfig(sub_batch_size=2, num_sub_batches=2),
                               optimizer=adamw)
    engine.train_step(batch(4, 8))
    after = snapshot(model)
    assert torch.equal(after["model.embed_tokens.weight"], init["model.embed_tokens.weight"])
    assert torch.equal(after["model.layers.0.mlp.up_proj.weight"], init["model.layers.0.mlp.up_proj.weight"])
    assert not torch.equal(after["model.layers.1.mlp.up_proj.weight"], init["model.layers.1.mlp.up_proj.weight"])


def test_model_holds_updated_weights_between_steps():
    """The user's model object is trained in place: after a step it computes with the new weights."""
    model = build("llama-tiny")
    init = snapshot(model)
    engine = SpeedLoaderEngine(model, SpeedLoaderConfig(sub_batch_size=2, num_sub_batches=2), optimizer=adamw)
    engine.train_step(batch(4, 8))
    assert all(p.device.type == "cpu" for p in model.parameters())
    moved = [k for k, v in snapshot(model).items() if not torch.equal(v, init[k])]
    assert "model.layers.0.mlp.up_proj.weight" in moved and "lm_head.weight" in moved
    fresh = build("llama-tiny")
    fresh.load_state_dict(engine.state_dict())
    ids = batch(2, 8, seed=5)
    with torch.no_grad():
        assert model(input_ids=ids, labels=ids).loss.item() == fresh(input_ids=ids, labels=ids).loss.item()
        assert model(input_ids=ids, labels=ids).loss.item() != \
            build("llama-tiny")(input_ids=ids, labels=ids).loss.item()


@pytest.mark.parametrize("schedule", ["speedloader", "canonical", "resident"])
def test_evaluate_equals_the_models_own_loss_and_trains_nothing(schedule):
    model = build("llama-tiny", seed=0).train()
    x = batches(1)[0]
    with torch.no_grad():
        expected = model(input_ids=x, labels=x).loss.item()
    engine = SpeedLoaderEngine(model, SpeedLoaderConfig(sub_batch_size=2, num_sub_batches=4, num_live_blocks=3,
                                                        schedule=schedule), optimizer=adamw)
    before = snapshot(engine.model)
    assert engine.evaluate(x) == pytest.approx(expected, rel=1e-5)
    assert all(torch.equal(v, before[k]) for k, v in snapshot(engine.model).items())
    assert engine.model.training


def test_a_config_of_another_backend_is_not_run_as_speedloader():
    """A best.yaml that DeepSpeed or FSDP won names its backend: the engine refuses it rather than train it as its
    own schedule."""
    with pytest.raises(ValueError, match="backend 'fsdp': this engine is SpeedLoader's; .*sltune train --config"):
        engine(backend="fsdp")


def test_generate_only_engine_refuses_to_train():
    eng = SpeedLoaderEngine(build("llama-tiny"), SpeedLoaderConfig(), optimizer=None)
    with pytest.raises(ValueError, match="optimizer=None"):
        eng.train_step(torch.zeros(1, 8, dtype=torch.long))


def test_optimizer_factory_must_return_an_optimizer():
    with pytest.raises(TypeError, match="torch.optim.Optimizer"):
        SpeedLoaderEngine(build("llama-tiny"), SpeedLoaderConfig(), optimizer=lambda ps: None)
