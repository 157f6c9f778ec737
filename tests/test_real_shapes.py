"""Real shapes on a small machine: trials built on the meta device with their buffers filled in place, and
specs or trials that cannot fit refused in one line before anything is built."""

import pytest
import torch

from sltune import SpeedLoaderConfig, SpeedLoaderEngine
from sltune.cli.main import main
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


def test_a_spec_no_config_of_which_fits_this_machine_is_refused_before_any_trial(tmp_path, capsys):
    spec = tmp_path / "big.yaml"
    spec.write_text("name: big\nmodel: {preset: llama-2-7b, dtype: bfloat16}\nworkload: {seq_len: 64}\n")
    assert main(["tune", str(spec), "--db", f"sqlite:///{tmp_path / 'jobs.db'}"]) == 2
    err = next(line for line in capsys.readouterr().err.splitlines() if line.startswith("sltune tune: error:"))
    assert "hardware.host_memory_limit is not set, so this machine's trial ceiling" in err
    # the prior of the smallest config, term by term (GiB): the parameters' own terms, the device's buffers (on the
    # CPU, host memory too) and the process; more ranks would not help, as the limit holds them all together
    assert "the weights in bfloat16 12.6, a float32 master copy 25.1, float32 gradients 25.1, AdamW's two moments " \
           "in float32 50.2, device buffers" in err and "the process" in err and "world_size" not in err
    assert main(["profile", "--model", "llama-2-7b", "--dtype", "bfloat16", "--host-memory-limit", "17GiB",
                 "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert "this trial cannot fit: --host-memory-limit 17.0 GiB is below the 117." in err
    assert "What would fit: no change of dtype, precision or optimizer" in err
