"""Plain PyTorch on the whole batch: the oracle the runtime is held to."""

from __future__ import annotations

import copy
import math

import torch

LR = 1e-3


def adamw(params):
    # eps=1e-6: a gradient that is zero in exact arithmetic (a key bias: softmax ignores a constant
    # shift) is float noise in both runs; with eps=1e-8 Adam would blow that noise up to lr-sized steps.
    return torch.optim.AdamW(params, lr=LR, eps=1e-6)


def plain_training(model, batches, make_optimizer=adamw, masks=None):
    """Train a deep copy the ordinary way; returns (model, losses, grads of the first step)."""
    model = copy.deepcopy(model)
    opt = make_optimizer(list(model.parameters()))
    losses, first_grads = [], None
    for step, ids in enumerate(batches):
        mask = None if masks is None else masks[step]
        labels = ids if mask is None else ids.masked_fill(mask == 0, -100)
        out = model(input_ids=ids, attention_mask=mask, labels=labels)
        out.loss.backward()
        if first_grads is None:
            first_grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        opt.step()
        opt.zero_grad()
        losses.append(out.loss.item())
    return model, losses, first_grads


def snapshot(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_same_updates(init, ours, ref, ref_grads, steps, rtol=1e-4):
    """Every parameter moved as in plain PyTorch: ||d_ours - d_ref|| <= rtol * ||d_ref||.

    A parameter whose reference gradient vanishes (norm below 1e-6 of the largest) only carries float
    noise, so it is held to an absolute bound instead: rtol * lr * steps per element (RMS).
    """
    gmax = max(g.norm().item() for g in ref_grads.values())
    worst = 0.0
    for name, r in ref.items():
        if not torch.is_floating_point(r):
            continue
        d_ours, d_ref = ours[name] - init[name], r - init[name]
        err = (d_ours - d_ref).norm().item()
        g = ref_grads.get(name)
        if g is not None and g.norm().item() < 1e-6 * gmax:
            bound = rtol * LR * steps * math.sqrt(r.numel())
        else:
            bound = rtol * d_ref.norm().item()
        worst = max(worst, err / max(bound, 1e-30) * rtol)
        assert err <= bound, f"{name}: update differs by {err:.3e} (bound {bound:.3e}, reference {d_ref.norm():.3e})"
    return worst


def mixed_training(model, batches, rows, dtype, make_optimizer=adamw, max_grad_norm=None, loss_scale=1.0):
    """Mixed precision the plain way: a float32 master, a `dtype` copy per micro-batch of `rows` rows, each
    micro-batch's gradients (of the loss times loss_scale) cast to float32 and summed, unscaled and clipped on
    the master, the optimizer on the master. Returns (master model, losses, grad norms)."""
    master = copy.deepcopy(model).float()
    opt = make_optimizer(list(master.parameters()))
    losses, norms = [], []
    for ids in batches:
        num_items = int((ids[:, 1:] != -100).sum())
        total = {n: torch.zeros_like(p) for n, p in master.named_parameters()}
        loss = 0.0
        for start in range(0, ids.shape[0], rows):
            low = copy.deepcopy(master)
            for p in low.parameters():       # buffers keep their dtype, as in transformers' bf16 models
                p.data = p.data.to(dtype)
            micro = ids[start:start + rows]
            out = low(input_ids=micro, labels=micro, num_items_in_batch=num_items)
            (out.loss * loss_scale).backward()
            loss += out.loss.item()
            for name, p in low.named_parameters():
                if p.grad is not None:
                    total[name] += p.grad.float()
        for name, p in master.named_parameters():
            p.grad = total[name] / loss_scale
        if max_grad_norm is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(master.parameters(), max_grad_norm)))
        opt.step()
        opt.zero_grad()
        losses.append(loss)
    return master, losses, norms
