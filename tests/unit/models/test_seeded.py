"""Real shapes on a small machine: trials built on the meta device with their buffers filled in place."""

import pytest
import torch

from sltune import SpeedLoaderConfig, SpeedLoaderEngine
from sltune.models import build, load_config
from sltune.models.seeded import SeededWeights


def test_seeded_weights_fill_the_engine_in_place_repeatably():
    """Norms one, biases zero, the rest the config's initializer_range: the magnitudes transformers' init
    gives, so a trial computes as a real model would; the same seed, the same weights."""
    weights = SeededWeights(load_config("qwen2-tiny"), seed=3)       # qwen2 has attention biases
    engine = SpeedLoaderEngine(weights.empty_model(), SpeedLoaderConfig(dtype="bfloat16"), optimizer=None,
                               weights=weights)
    state = engine.state_dict()
    reference = build("qwen2-tiny").state_dict()
    assert state.keys() == reference.keys()
    for name, value in state.items():
        assert value.shape == reference[name].shape and value.dtype == torch.bfloat16, name
        if name.endswith("norm.weight"):
            assert torch.equal(value, torch.ones_like(value)), name
        elif name.endswith("bias"):
            assert torch.equal(value, torch.zeros_like(value)), name
        else:
            assert value.float().std().item() == pytest.approx(0.02, rel=0.05), name
    again = SeededWeights(load_config("qwen2-tiny"), seed=3)
    other = SpeedLoaderEngine(again.empty_model(), SpeedLoaderConfig(dtype="bfloat16"), optimizer=None,
                              weights=again).state_dict()
    assert all(torch.equal(other[k], v) for k, v in state.items())
    tokens = engine.generate(torch.randint(3, 500, (1, 8)), max_new_tokens=2)       # and it runs
    assert tokens.shape == (1, 10)
