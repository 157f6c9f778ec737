"""A model's shape (sltune.tuning.cost.shape): the bytes a share of weights kept on the device holds are the ones
the engine keeps."""

import pytest

from sltune.tuning.cost.shape import shape_of


@pytest.mark.parametrize("preset", ["llama-tiny", "llama-tiny-tied", "gpt2-tiny"])
def test_the_tuners_kept_bytes_are_what_the_engine_keeps(preset):
    """The fits and the pruning floor predict a share's kept bytes from the model's shape; the engine keeps
    units of the built model: the same units, so the same bytes, for every k (3 does not divide 4 layers)."""
    from sltune import SpeedLoaderConfig, SpeedLoaderEngine
    from sltune.models import build

    shape = shape_of(preset)
    for k in (1, 2, 3):
        for share in (0.0, 0.3, 0.5, 0.8, 1.0):
            cfg = SpeedLoaderConfig(num_live_blocks=k, weights_on_device=share, memory_tracking="never")
            engine = SpeedLoaderEngine(build(preset), cfg, optimizer=None)
            assert sum(u.nbytes for u in engine.kept_units) == shape.kept_bytes(k, share), (k, share)
