"""The input embedding's gradient as the rows a sub-batch touched: added into a sum it equals the dense
backward's to the bit (repeated tokens, padding, every dtype), and the engine leaves the user's module as it was."""

import pytest
import torch
import torch.nn.functional as F

from sltune import SpeedLoaderConfig, SpeedLoaderEngine
from sltune.models import build
from sltune.runtime import rowgrads
from sltune.runtime.rowgrads import add_rows, row_embedding, sparse_rows
from tests.support.reference import adamw


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("vocab,hidden,tokens,padding_idx", [(50, 64, 160, None), (8192, 96, 4096, 0),
                                                             (300, 8, 20000, None), (7, 3, 1, None)])
def test_rows_add_into_a_sum_as_the_dense_gradient_does(dtype, vocab, hidden, tokens, padding_idx):
    g = torch.Generator().manual_seed(vocab)
    w = torch.randn(vocab, hidden, dtype=dtype, generator=g).requires_grad_()
    ids = torch.randint(0, min(vocab, 97), (tokens,), generator=g)       # few distinct tokens: many repeats
    gy = torch.randn(tokens, hidden, dtype=dtype, generator=g)
    F.embedding(ids, w, padding_idx=padding_idx).backward(gy)
    dense, w.grad = w.grad, None
    F.embedding(ids, w, padding_idx=padding_idx, sparse=True).backward(gy)
    rows = w.grad
    assert rows.is_sparse and not dense.is_sparse
    for start in (torch.randn(vocab, hidden, generator=g), torch.zeros(vocab, hidden)):
        for into in (start, start.to(dtype)):      # a float32 sum, and a gradient held in the weight's dtype
            expected, ours = into.clone().add_(dense), into.clone()
            add_rows(ours, rows)
            assert torch.equal(ours, expected)


def test_the_switch_is_for_its_span_only_and_keeps_a_users_own_setting():
    model = build("llama-tiny", seed=0)
    emb = row_embedding(model)
    assert emb is model.get_input_embeddings() and not emb.sparse
    with sparse_rows(emb):
        assert emb.sparse
    assert not emb.sparse
    emb.sparse = True
    with sparse_rows(emb):
        pass
    assert emb.sparse                               # the user's own choice stays
    emb.sparse = False
    emb.weight.requires_grad_(False)
    assert row_embedding(model) is None             # a frozen embedding makes no gradient at all


@pytest.mark.parametrize("preset,dtype", [("llama-tiny", "float32"), ("llama-tiny-tied", "float32"),
                                          ("llama-tiny", "bfloat16")])
def test_the_engine_adds_the_embeddings_rows_and_leaves_the_module_dense(preset, dtype, monkeypatch):
    """The rows path is the one taken (each sub-batch's rows reach add_rows), and after a step the user's
    module is as it was. That its sums equal plain PyTorch's to the bit is test_precision.py's and
    test_engine.py's."""
    seen = []

    def counted(dst, grad):
        seen.append(grad._values().shape[0])
        rowgrads_add(dst, grad)

    rowgrads_add = rowgrads.add_rows
    monkeypatch.setattr("sltune.runtime.rowgrads.add_rows", counted)
    monkeypatch.setattr("sltune.runtime.params.add_rows", counted)
    model = build(preset, seed=0)
    engine = SpeedLoaderEngine(model, SpeedLoaderConfig(dtype=dtype, sub_batch_size=2, num_sub_batches=3),
                               optimizer=adamw)
    engine.train_step(torch.randint(3, 40, (6, 16), generator=torch.Generator().manual_seed(0)))
    assert seen and all(n == 2 * 16 for n in seen)          # b*s rows per sub-batch, not the vocabulary
    assert not model.get_input_embeddings().sparse
    assert all(p.grad is None or not p.grad.is_sparse for p in model.parameters())
