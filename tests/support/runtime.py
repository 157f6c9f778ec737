"""One engine run held to plain PyTorch: the batches, the run and the check the runtime's exactness tests share
(equivalence, activations, the emulated device), and the pad id generation uses."""

import pytest
import torch

from sltune import SpeedLoaderConfig, SpeedLoaderEngine
from sltune.models import build
from tests.support.reference import adamw, assert_same_updates, plain_training, snapshot


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op thread here and in every child: OpenMP's pool does not survive a fork, and the children and
    this process then compute alike to the bit."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


FAMILIES = ["llama-tiny", "llama-tiny-tied", "mistral-tiny", "qwen2-tiny", "gpt2-tiny", "opt-tiny"]


def run_engine(preset, batches, masks=None, seed=0, **knobs):
    model = build(preset, seed=seed)
    init = snapshot(model)
    ref_model, ref_losses, ref_grads = plain_training(model, batches, masks=masks)
    engine = SpeedLoaderEngine(model, SpeedLoaderConfig(**knobs), optimizer=adamw)
    results = []
    for step, ids in enumerate(batches):
        mask = None if masks is None else masks[step]
        labels = ids if mask is None else ids.masked_fill(mask == 0, -100)
        results.append(engine.train_step(ids, labels=labels, attention_mask=mask))
    return init, engine, results, ref_model, ref_losses, ref_grads


def check(init, engine, results, ref_model, ref_losses, ref_grads):
    for res, ref in zip(results, ref_losses):
        assert res.loss == pytest.approx(ref, rel=1e-5)
    assert_same_updates(init, snapshot(engine.model), snapshot(ref_model), ref_grads, steps=len(results))
    assert engine.state_dict().keys() == ref_model.state_dict().keys()


def batch(rows, seq, vocab=512, seed=1):
    return torch.randint(3, vocab, (rows, seq), generator=torch.Generator().manual_seed(seed))


PAD = 0                       # gpt2-tiny has no pad token; transformers needs one for finished rows
