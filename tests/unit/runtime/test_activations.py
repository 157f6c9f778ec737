"""`activations: recompute | offload`, the turnaround and resident's plain autograd: exact against plain
PyTorch, and recomputing exactly what each promises (counted on the model's own layers)."""

import pytest
import torch

from sltune import SpeedLoaderConfig, SpeedLoaderEngine
from sltune.models import build
from tests.support.reference import adamw, assert_same_updates, plain_training, snapshot
from tests.support.runtime import FAMILIES, batch, check, run_engine


@pytest.mark.parametrize("schedule", ["speedloader", "canonical"])
@pytest.mark.parametrize("preset", FAMILIES)
def test_offload_matches_plain_pytorch(preset, schedule):
    check(*run_engine(preset, [batch(6, 12)], sub_batch_size=2, num_sub_batches=3, num_live_blocks=1,
                      schedule=schedule, activations="offload"))


@pytest.mark.parametrize("knobs", [
    dict(sub_batch_size=2, num_sub_batches=3, num_live_blocks=3),    # 4 layers: groups of 3 and 1
    dict(sub_batch_size=2, num_sub_batches=3, num_live_blocks=9),    # one group: only the turnaround
    dict(sub_batch_size=1, num_sub_batches=6, num_live_blocks=2),    # sub-batches of one row
], ids=["k-not-dividing", "k-above-layers", "rows-of-one"])
def test_offload_awkward_shapes_over_two_steps(knobs):
    check(*run_engine("llama-tiny", [batch(6, 12, seed=1), batch(6, 12, seed=2)], activations="offload", **knobs))


def test_offload_follows_a_changing_sequence_length():
    """A key's saved tensors go into slabs sized by what it packed on the step before: a longer sequence
    overflows them, a shorter one leaves them too large. Either way the result is exact, and once a length
    repeats, host memory holds what the step packed and no more (the longer step's slabs are gone)."""
    batches = [batch(6, 12, seed=1), batch(6, 20, seed=2), batch(6, 12, seed=3), batch(6, 12, seed=4)]
    init, engine, results, *ref = run_engine("llama-tiny", batches, sub_batch_size=2, num_sub_batches=3,
                                             num_live_blocks=1, activations="offload")
    check(init, engine, results, *ref)
    assert engine.saved.held_bytes == engine.saved.packed_bytes > 0
    assert results[-1].io == engine.expected_io(12)


@pytest.mark.parametrize("activations", ["recompute", "offload"])
@pytest.mark.parametrize("schedule", ["speedloader", "canonical"])
@pytest.mark.parametrize("frozen", [["model.embed_tokens", "model.layers.0"], ["model.layers.2"]],
                         ids=["prefix", "middle"])
def test_frozen_layers_match_plain_pytorch(frozen, schedule, activations):
    model = build("llama-tiny")
    for name in frozen:
        model.get_submodule(name).requires_grad_(False)
    init = snapshot(model)
    ids = batch(6, 12)
    ref_model, ref_losses, ref_grads = plain_training(model, [ids])
    engine = SpeedLoaderEngine(model, SpeedLoaderConfig(sub_batch_size=2, num_sub_batches=3, num_live_blocks=1,
                               schedule=schedule, activations=activations), optimizer=adamw)
    check(init, engine, [engine.train_step(ids)], ref_model, ref_losses, ref_grads)
    assert io_matches(engine, 12)


def io_matches(engine, seq):
    return engine.io == engine.expected_io(seq)


@pytest.mark.parametrize("activations", ["recompute", "offload"])
def test_dropout_exact_with_several_sub_batches(activations):
    """Dropout on, 3 sub-batches: each sub-batch is its own plain-PyTorch micro-batch with the same draws, so
    a recompute that failed to replay its masks, or an offload that lost one, would not match."""
    cfg = {"model_type": "gpt2", "vocab_size": 512, "n_embd": 64, "n_layer": 4, "n_head": 4,
           "resid_pdrop": 0.2, "embd_pdrop": 0.2, "attn_pdrop": 0.2}
    model = build(cfg, seed=0).train()
    init = snapshot(model)
    ids = batch(6, 12)
    # the reference: plain autograd on the three micro-batches in the order the engine draws them: every
    # sub-batch's embedding first, then group by group (k=2: layers 0-1 for all, then 2-3 + head for all)
    ref = build(cfg, seed=0).train()
    ref.load_state_dict(init)
    torch.manual_seed(7)
    engine = SpeedLoaderEngine(model, SpeedLoaderConfig(sub_batch_size=2, num_sub_batches=3, num_live_blocks=2,
                               activations=activations), optimizer=adamw)
    res = engine.train_step(ids)
    torch.manual_seed(7)
    loss = _plain_in_engine_order(ref, ids, rows=2, split=2)
    assert res.loss == pytest.approx(loss.item(), rel=1e-5)
    grads = {n: p.grad.clone() for n, p in ref.named_parameters() if p.grad is not None}
    opt = adamw(list(ref.parameters()))
    opt.step()
    assert_same_updates(init, snapshot(model), snapshot(ref), grads, steps=1)


def _plain_in_engine_order(model, ids, rows, split):
    """The engine's loss on `ids` with plain autograd, drawing dropout in the engine's order (all sub-batches
    through the embedding, then through layers [0:split], then the rest and the head), one backward."""
    from sltune.runtime.family import CausalLM

    lm = CausalLM(model)
    subs = ids.split(rows)
    num_items = ids[:, 1:].numel()
    starts = [lm.prologue(sb, None, use_cache=False) for sb in subs]
    mids = [lm.run_layers(0, split, h, calls) for h, calls in starts]
    losses = [lm.loss(lm.logits(lm.run_layers(split, len(lm.layers), h, calls)), sb, num_items)
              for h, (_, calls), sb in zip(mids, starts, subs)]
    total = torch.stack(losses).sum()
    total.backward()
    return total


@pytest.mark.parametrize("schedule,activations,body_runs", [
    ("resident", "recompute", 1), ("speedloader", "recompute", 2), ("speedloader", "offload", 1),
    ("canonical", "recompute", 2), ("canonical", "offload", 1)])
def test_what_is_recomputed(schedule, activations, body_runs):
    """Forward calls per layer in one step of N sub-batches: the turnaround group (the last) and the
    embedding run once per sub-batch everywhere; the groups below it twice under recompute, once otherwise."""
    model = build("llama-tiny")
    calls = {name: 0 for name in ["embed", *range(4)]}
    model.model.embed_tokens.register_forward_hook(lambda *_: calls.__setitem__("embed", calls["embed"] + 1))
    for j, layer in enumerate(model.model.layers):     # the MLP: the prologue's recorders never call it
        layer.mlp.register_forward_hook(lambda *_, j=j: calls.__setitem__(j, calls[j] + 1))
    n = 3
    engine = SpeedLoaderEngine(model, SpeedLoaderConfig(sub_batch_size=2, num_sub_batches=n, num_live_blocks=2,
                               schedule=schedule, activations=activations), optimizer=adamw)
    engine.train_step(batch(2 * n, 12))
    assert calls == {"embed": n, 0: body_runs * n, 1: body_runs * n, 2: n, 3: n}


@pytest.mark.parametrize("preset", ["llama-tiny", "gpt2-tiny", "opt-tiny"])
def test_offloaded_bytes_are_what_plain_autograd_saves(preset):
    """Per layer and sub-batch, the bytes offload packs to host memory equal what autograd saves in the
    model's own forward (each tensor once, parameters excluded), counted here with saved-tensor hooks."""
    ids = batch(2, 12)
    model = build(preset)
    engine = SpeedLoaderEngine(model, SpeedLoaderConfig(sub_batch_size=2, num_sub_batches=1, num_live_blocks=1,
                               activations="offload"), optimizer=adamw)
    engine.train_step(ids)
    packed = dict(engine.saved.nbytes)
    assert engine.io.act_offload_bytes == engine.expected_io(12).act_offload_bytes

    plain = build(preset)
    params = {p.untyped_storage().data_ptr() for p in plain.parameters()}
    per_layer: dict[int, dict] = {}
    current = [None]
    for j, layer in enumerate(plain.get_decoder().layers if hasattr(plain.get_decoder(), "layers")
                              else plain.get_decoder().h):
        layer.register_forward_pre_hook(lambda *_, j=j: current.__setitem__(0, j))
        layer.register_forward_hook(lambda *_: current.__setitem__(0, None))

    def pack(t):
        st = t.untyped_storage()
        if current[0] is not None and st.data_ptr() not in params:
            per_layer.setdefault(current[0], {})[(st.data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(),
                                                  t.dtype)] = t.numel() * t.element_size()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        plain(input_ids=ids, labels=ids).loss.backward()
    expected = {j: sum(v.values()) for j, v in per_layer.items()}
    last = len(expected) - 1                   # the turnaround's layer keeps its graph on the device
    assert {e: packed[(e, 0)] for e in range(last)} == {j: expected[j] for j in range(last)}
    assert all(v > 0 for v in expected.values())
