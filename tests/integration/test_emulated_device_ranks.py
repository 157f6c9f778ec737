"""Two gloo ranks under torchrun on the emulated asynchronous device: exact against plain PyTorch, and the
sharded prefetch does not wait for the gather."""

import json

import pytest
import torch

from sltune.models import build
from sltune.runtime.streams import ENV
from tests.support.dist_script import batch as dist_batch
from tests.support.distributed import torchrun
from tests.support.emulated_dist_script import LATE
from tests.support.reference import assert_same_updates, plain_training, snapshot


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("emulated") / "report.json"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(ENV, "lazy")
        r = torchrun("tests/support/emulated_dist_script.py", str(out))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return out, json.loads(out.read_text())


@pytest.mark.parametrize("schedule", ["speedloader", "canonical"])
def test_two_ranks_are_exact_on_the_emulated_device(two_ranks, schedule):
    out, report = two_ranks
    model = build("llama-tiny")
    ref_model, ref_losses, ref_grads = plain_training(model, [torch.cat([dist_batch(0, r) for r in range(2)])])
    assert report["runs"][schedule] == pytest.approx(ref_losses, rel=1e-5)
    assert_same_updates(snapshot(model), torch.load(f"{out}.{schedule}.pt"), snapshot(ref_model), ref_grads, steps=1)


def test_the_sharded_prefetch_does_not_wait_for_the_gather(two_ranks):
    """Finding 4: the prefetch returned only once the all-gather had finished, i.e. once the late rank came."""
    _, report = two_ranks
    assert report["gathered"]
    assert report["issued"] < LATE / 2 < LATE * 0.8 < report["ready"], report
