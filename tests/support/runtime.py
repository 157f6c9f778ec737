"""One engine run held to plain PyTorch: the batches, the run and the check the runtime's exactness tests share
(equivalence, activations, the emulated device), and the pad id generation uses; an engine of llama-tiny, the
batches of the precision tests, a Copier on the emulated device and the `emulated` fixture that turns the device on."""

import pytest
import torch

from sltune import SpeedLoaderConfig, SpeedLoaderEngine
from sltune.models import build
from sltune.runtime.counters import IOCounters
from sltune.runtime.emulated import EmulatedStreams
from sltune.runtime.streams import ENV
from sltune.runtime.transfer import Copier
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


@pytest.fixture
def emulated(monkeypatch):
    monkeypatch.setenv(ENV, "lazy")


def copier() -> Copier:
    return Copier(torch.device("cpu"), IOCounters(), EmulatedStreams())


def batches(steps=2, rows=8, seq=16):
    return [torch.randint(3, 512, (rows, seq), generator=torch.Generator().manual_seed(s + 1)) for s in range(steps)]


def engine(**knobs):
    return SpeedLoaderEngine(build("llama-tiny"), SpeedLoaderConfig(**knobs), optimizer=adamw)
