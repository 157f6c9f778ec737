"""Mixed precision (sltune.runtime.precision): float32 masters on the host, the device computing in
bfloat16/float16, equal to the plain PyTorch recipe (a float32 master, a low-precision copy per micro-batch, float32
gradient sums); float16's loss scaling; the global-norm clipping of torch.nn.utils.clip_grad_norm_; half precision on
the CPU, and an optimizer eps that float16 rounds to 0."""

import warnings

import pytest
import torch

from sltune import SpeedLoaderConfig, SpeedLoaderEngine
from sltune.models import build
from sltune.training import OptimizerConfig
from tests.support.reference import adamw, assert_same_updates, mixed_training, plain_training, snapshot
from tests.support.runtime import batches


def run_mixed(preset="llama-tiny", dtype="bfloat16", max_grad_norm=None, data=None, **knobs):
    data = data or batches()
    model = build(preset, seed=0)
    init = snapshot(model)
    rows = knobs.get("sub_batch_size", 2)
    ref, ref_losses, ref_norms = mixed_training(model, data, rows, getattr(torch, dtype), max_grad_norm=max_grad_norm,
                                                loss_scale=2.0 ** 16 if dtype == "float16" else 1.0)
    cfg = SpeedLoaderConfig(dtype=dtype, num_sub_batches=data[0].shape[0] // rows, **{"sub_batch_size": rows, **knobs})
    engine = SpeedLoaderEngine(model, cfg, optimizer=adamw, max_grad_norm=max_grad_norm)
    results = [engine.train_step(x) for x in data]
    return init, engine, results, ref, ref_losses, ref_norms


KNOBS = {
    "speedloader-recompute": dict(schedule="speedloader", activations="recompute", num_live_blocks=1),
    "speedloader-offload-k-not-dividing": dict(schedule="speedloader", activations="offload", num_live_blocks=3),
    "canonical": dict(schedule="canonical", num_live_blocks=2),
    "resident": dict(schedule="resident"),
}


@pytest.mark.parametrize("knobs", KNOBS.values(), ids=KNOBS.keys())
def test_mixed_bfloat16_equals_the_plain_master_recipe(knobs):
    init, engine, results, ref, ref_losses, _ = run_mixed(**knobs)
    assert [r.loss for r in results] == pytest.approx(ref_losses, rel=1e-6)
    ours, theirs = engine.state_dict(), ref.state_dict()
    for name, value in theirs.items():
        assert ours[name].dtype == torch.float32, name                  # the state is the float32 master
        assert torch.equal(ours[name], value), name                     # the same sums, the same AdamW: bit for bit
    assert next(engine.model.parameters()).dtype == torch.bfloat16      # the model holds the dtype copy
    model_weights = dict(engine.model.named_parameters())
    for name, value in theirs.items():
        assert torch.equal(model_weights[name].data, value.to(torch.bfloat16)), name
    if knobs["schedule"] != "resident":
        assert results[-1].io == engine.expected_io(16)                # gradients move in float32, params in bf16


def test_tied_weights_sum_their_two_uses_in_float32():
    """The plain recipe adds a tied weight's head and embedding gradients in bfloat16 before the float32 sum;
    the engine sums each use in float32: equal up to bfloat16's rounding of that one addition."""
    init, engine, results, ref, ref_losses, _ = run_mixed("llama-tiny-tied", num_live_blocks=2, data=batches(1))
    assert [r.loss for r in results] == pytest.approx(ref_losses, rel=1e-6)
    ours, theirs = engine.state_dict(), ref.state_dict()
    tied = "model.embed_tokens.weight"
    for name, value in theirs.items():
        if name not in (tied, "lm_head.weight"):   # one step: only the tied weight's gradient saw the other rounding
            assert torch.equal(ours[name], value), name
    moved = (theirs[tied] - init[tied]).norm()
    assert 0 < (ours[tied] - theirs[tied]).norm() <= 1e-2 * moved


def test_a_bfloat16_step_at_a_fine_tuning_rate_moves_every_weight():
    """Without a master, bfloat16 rounds most lr=1e-5 AdamW updates away; with it, the step lands."""
    data = [torch.randint(3, 8192, (2, 16), generator=torch.Generator().manual_seed(0))]
    unchanged = {}
    for mixed in (True, False):
        model = build("llama-small", seed=0)
        engine = SpeedLoaderEngine(model, SpeedLoaderConfig(dtype="bfloat16", sub_batch_size=1, num_sub_batches=2,
                                                            num_live_blocks=4, mixed_precision=mixed),
                                   optimizer=OptimizerConfig(lr=1e-5).factory)
        before = {k: v.clone() for k, v in engine.state_dict().items()}
        engine.train_step(data[0])
        after = engine.state_dict()
        same = sum(int((after[k] == before[k]).sum()) for k in before if after[k].is_floating_point())
        unchanged[mixed] = same / sum(v.numel() for v in before.values() if v.is_floating_point())
    assert unchanged[True] <= 0.01, unchanged
    assert unchanged[False] >= 0.5, unchanged       # the failure the master fixes, measured beside it


def test_clipping_equals_clip_grad_norm_on_the_whole_model():
    data = batches()
    model = build("llama-tiny-tied", seed=0)
    init = snapshot(model)
    norms = []

    def clipped_plain(params):
        opt = adamw(params)
        step = opt.step

        def clip_then_step(*a, **k):
            norms.append(float(torch.nn.utils.clip_grad_norm_(params, 0.05)))
            return step(*a, **k)
        opt.step = clip_then_step
        return opt

    ref, ref_losses, ref_grads = plain_training(model, data, make_optimizer=clipped_plain)
    engine = SpeedLoaderEngine(model, SpeedLoaderConfig(sub_batch_size=2, num_sub_batches=4, num_live_blocks=3),
                               optimizer=adamw, max_grad_norm=0.05)
    results = [engine.train_step(x) for x in data]
    assert [r.grad_norm for r in results] == pytest.approx(norms, rel=1e-5)
    assert all(n > 0.05 for n in norms)            # the clip acted on every step
    assert_same_updates(init, snapshot(engine.model), snapshot(ref), ref_grads, steps=2)


def test_mixed_clipping_reports_the_unclipped_norm():
    """The first step's norm agrees to float32 rounding (the engine sums per unit, torch per tensor); that
    rounding moves a few bfloat16 copies by one ulp, so the second step's agrees to bfloat16's."""
    *_, results, _, _, ref_norms = run_mixed(max_grad_norm=0.05, num_live_blocks=2)
    assert results[0].grad_norm == pytest.approx(ref_norms[0], rel=1e-5)
    assert results[1].grad_norm == pytest.approx(ref_norms[1], rel=2e-3)
    assert min(ref_norms) > 0.05


def test_float16_overflow_is_skipped_and_the_scale_halves():
    model = build("llama-tiny", seed=0)
    engine = SpeedLoaderEngine(model, SpeedLoaderConfig(dtype="float16", sub_batch_size=2, num_sub_batches=2),
                               optimizer=adamw)
    x = batches(1, rows=4)[0]
    first = engine.train_step(x)
    assert first.loss_scale == 2.0 ** 16 and not first.skipped and first.grad_norm is not None
    before = {k: v.clone() for k, v in engine.state_dict().items()}
    state = {k: v.clone() for k, v in engine.optimizer.state_dict()["state"][0].items()}
    engine.scaler.scale = 2.0 ** 100          # gradients times 2^100 overflow float16
    with pytest.warns(RuntimeWarning, match="overflowed .* step skipped"):
        skipped = engine.train_step(x)
    assert skipped.skipped and skipped.loss_scale == 2.0 ** 100
    assert engine.scaler.scale == 2.0 ** 99 and engine.scaler.skipped == 1
    after = engine.state_dict()
    assert all(torch.equal(after[k], before[k]) for k in before)        # nothing stepped
    assert torch.equal(engine.optimizer.state_dict()["state"][0]["exp_avg"], state["exp_avg"])
    engine.scaler.scale = 2.0 ** 16
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ok = engine.train_step(x)
    assert not ok.skipped and not torch.equal(engine.state_dict()["lm_head.weight"], before["lm_head.weight"])


def test_float16_mixed_equals_the_plain_recipe_at_the_same_scale():
    """GradScaler's recipe by hand (the loss times 2^16, float32 sums unscaled on the master) gives the same
    masters bit for bit."""
    init, engine, results, ref, ref_losses, _ = run_mixed(dtype="float16", num_live_blocks=2)
    assert [r.loss for r in results] == pytest.approx(ref_losses, rel=1e-6)
    ours, theirs = engine.state_dict(), ref.state_dict()
    for name, value in theirs.items():
        assert torch.equal(ours[name], value), name


def test_an_engine_that_only_generates_holds_no_master_and_no_gradients():
    engine = SpeedLoaderEngine(build("llama-tiny"), SpeedLoaderConfig(dtype="bfloat16"), optimizer=None)
    assert all(u.master is None and u.host_grad is None for u in engine.units)
    trainer = SpeedLoaderEngine(build("llama-tiny"), SpeedLoaderConfig(dtype="bfloat16"), optimizer=adamw)
    assert all(u.master is not None and u.master.dtype == torch.float32 for u in trainer.units if u.params)
    assert all(u.host_grad.dtype == torch.float32 for u in trainer.units if u.has_grads)
    pure = SpeedLoaderEngine(build("llama-tiny"), SpeedLoaderConfig(dtype="bfloat16", mixed_precision=False),
                             optimizer=adamw)
    assert all(u.master is None and u.host_grad.dtype == torch.bfloat16 for u in pure.units if u.has_grads)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_trains_on_cpu(dtype):
    # float16 keeps AdamW's state in float16 too (as model.half() would): eps=1e-8 is 0 there, so 1e-4
    eng = SpeedLoaderEngine(build("llama-tiny"), SpeedLoaderConfig(dtype=dtype, sub_batch_size=2,
                            num_sub_batches=2), optimizer=lambda ps: torch.optim.AdamW(ps, lr=3e-3, eps=1e-4))
    ids = torch.randint(3, 512, (4, 8), generator=torch.Generator().manual_seed(0))
    losses = [eng.train_step(ids).loss for _ in range(8)]
    assert losses[-1] < losses[0] - 0.5, losses           # it learns the batch
    assert all(p.dtype == getattr(torch, dtype) for p in eng.model.parameters())


def test_an_optimizer_eps_that_vanishes_in_float16_is_flagged():
    """Only where the optimizer steps float16 itself: a float32 master keeps eps=1e-8 as it is."""
    with pytest.warns(UserWarning, match="eps=1e-08 is 0 in float16"):
        SpeedLoaderEngine(build("llama-tiny"), SpeedLoaderConfig(dtype="float16", mixed_precision=False),
                          optimizer=lambda ps: torch.optim.AdamW(ps))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        SpeedLoaderEngine(build("llama-tiny"), SpeedLoaderConfig(dtype="float16"),
                          optimizer=lambda ps: torch.optim.AdamW(ps))
