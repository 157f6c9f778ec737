"""A tensor larger than a block (a vocabulary's embedding) is stepped by the disk tier slice by slice
(sltune.runtime.disk.layout.pieces), so the window's slots are a block's size, not the largest tensor's; the result
is the whole tensor's step to the bit. The engine runs with blocks of 4096 values (llama-tiny's embedding is 8 of
them, its MLP weights 3); AdamW itself is checked at the real BLOCK_NUMEL."""

import pytest
import torch

from sltune import SpeedLoaderConfig, SpeedLoaderEngine
from sltune.models import build
from sltune.runtime.disk import layout as disk_layout
from sltune.runtime.disk.files import read_committed
from sltune.runtime.disk.layout import BLOCK_NUMEL, padded, pieces
from tests.support.reference import adamw

SEQ = 8
SMALL = 4096


@pytest.fixture
def small_blocks(monkeypatch):
    monkeypatch.setattr(disk_layout, "BLOCK_NUMEL", SMALL)


def train(folder, optimizer_offload, param_offload="host", tied=False, clip=None, steps=3, **knobs):
    knobs = {"sub_batch_size": 2, "num_sub_batches": 2, "num_live_blocks": 1, "dtype": "bfloat16", **knobs}
    disk = "disk" in (optimizer_offload, param_offload)
    cfg = SpeedLoaderConfig(**knobs, optimizer_offload=optimizer_offload, param_offload=param_offload,
                            offload_dir=str(folder) if disk else None)
    engine = SpeedLoaderEngine(build("llama-tiny-tied" if tied else "llama-tiny", seed=0), cfg, optimizer=adamw,
                               max_grad_norm=clip, track_grad_norm=True)
    rows = cfg.effective_batch_size
    data = [torch.randint(3, 512, (rows, SEQ), generator=torch.Generator().manual_seed(s)) for s in range(steps)]
    return engine, [engine.train_step(x) for x in data]


def test_pieces_cut_at_block_multiples():
    assert pieces(0) == [(0, 0)] and pieces(5) == [(0, 5)] and pieces(BLOCK_NUMEL) == [(0, BLOCK_NUMEL)]
    assert pieces(2 * BLOCK_NUMEL + 3) == [(0, BLOCK_NUMEL), (BLOCK_NUMEL, BLOCK_NUMEL), (2 * BLOCK_NUMEL, 3)]


def test_adamw_on_slices_of_a_block_equals_adamw_on_the_tensor():
    """What the disk tier does to a tensor over a block, at the real BLOCK_NUMEL: each slice stepped as the
    tensor, from the counters it had before (sltune.runtime.stepping), gives the whole step's bits."""
    n = BLOCK_NUMEL + 1000
    gen = torch.Generator().manual_seed(0)
    start, grads = torch.randn(n, generator=gen), [torch.randn(n, generator=gen) for _ in range(2)]
    whole = torch.nn.Parameter(start.clone())
    opt = adamw([whole])
    for g in grads:
        whole.grad = g
        opt.step()
    sliced = torch.nn.Parameter(start.clone())
    opt2, values = adamw([sliced]), sliced.data
    moments = {}
    for g in grads:
        state, before = opt2.state[sliced], {k: v.clone() for k, v in opt2.state[sliced].items() if k == "step"}
        for a, m in pieces(n):
            state.clear()
            state.update({k: v.clone() for k, v in before.items()})
            if before:          # from the second step: the moments so far (the first makes them fresh)
                state.update({k: v[a:a + m] for k, v in moments.items()})
            sliced.data, sliced.grad = values[a:a + m], g[a:a + m]
            opt2.step()
            for key in ("exp_avg", "exp_avg_sq"):
                moments.setdefault(key, torch.zeros(n))[a:a + m].copy_(state[key])
        sliced.data = values
    assert torch.equal(whole.data, values)
    assert all(torch.equal(opt.state[whole][k], moments[k]) for k in moments)


CASES = {
    "bf16": {},
    "fp32-no-master": {"dtype": "float32"},                            # the values stepped in place, slice by slice
    "tied-clip-weights-on-disk": {"tied": True, "clip": 0.05, "param_offload": "disk"},
}


@pytest.mark.parametrize("case", CASES)
def test_a_tensor_over_a_block_steps_in_slices_bit_for_bit(tmp_path, small_blocks, case):
    knobs = CASES[case]
    host, host_res = train(tmp_path, "host", **{k: v for k, v in knobs.items() if k != "param_offload"})
    disk, disk_res = train(tmp_path, "disk", **knobs)
    assert [r.loss for r in host_res] == [r.loss for r in disk_res]
    assert [r.grad_norm for r in host_res] == [r.grad_norm for r in disk_res]
    ours, theirs = host.state_dict(), disk.state_dict()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    # the embedding is in eight blocks, and no slot is larger than a block's master and state
    assert disk.model.get_input_embeddings().weight.numel() == 8 * SMALL
    assert max(b.numel for b in disk.disk.blocks) == SMALL
    assert sum(s.part is not None for b in disk.disk.blocks for s in b.items) > 8
    per_value = (4 if disk.params.master else 0) + sum(d.itemsize for _, d in disk.disk.layout)
    assert disk.disk.window_bytes <= 3 * padded(SMALL * per_value)
    # the committed files hold each tensor whole once its slices are put back together: the host optimizer's state
    saved = read_committed(disk.disk.folder)
    state = host.optimizer.state_dict()["state"]
    assert saved["tensors"].keys() == state.keys()
    for index, tensors in saved["tensors"].items():
        assert torch.equal(tensors["exp_avg"], state[index]["exp_avg"].reshape(-1)), index
        assert torch.equal(tensors["exp_avg_sq"], state[index]["exp_avg_sq"].reshape(-1)), index
        assert state[index]["step"] == saved["optimizer"]["state"][index]["step"]
