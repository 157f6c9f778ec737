"""Loading a Hugging Face checkpoint to train holds the bytes the formula documents, measured in a fresh
process (its peak resident memory over its own imports)."""

import json
import subprocess
import sys
import textwrap

import torch

from sltune.models import build
from sltune.training import OptimizerConfig


# Measured in a fresh process: the peak resident memory of loading a checkpoint and taking the first step, over
# the process's own before it (its imports included), against the documented sum (sltune.tuning.cost.shape
# host_terms: the dtype copy, the float32 master, gradients, AdamW's moments). On the CPU the "device" is the
# same memory: the buffers the engine's device pool holds are subtracted (on a GPU they are HBM).
_PEAK = textwrap.dedent("""
    import json, sys
    import torch
    from sltune import SpeedLoaderConfig, SpeedLoaderEngine
    from sltune.models.checkpoint import Checkpoint
    from sltune.profiling.child import forget_fork_server_heap, resident_bytes
    from sltune.training import OptimizerConfig
    Checkpoint(sys.argv[1]).empty_model()            # the imports a load needs: the process's baseline
    forget_fork_server_heap()
    before = resident_bytes()
    engine = SpeedLoaderEngine.from_pretrained(sys.argv[1], SpeedLoaderConfig(dtype="bfloat16"),
                                               optimizer=OptimizerConfig().factory)
    loaded = resident_bytes(peak=True) - before
    engine.train_step(torch.randint(3, 100, (1, 8)))
    print(json.dumps({"loaded": loaded, "grown": resident_bytes(peak=True) - before,
                      "device_pool": engine.pool.held_bytes}))
""")


def test_loading_a_checkpoint_to_train_holds_the_documented_bytes(tmp_path):
    from sltune.tuning.cost.shape import shape_of

    build("llama-small", seed=0).to(torch.bfloat16).save_pretrained(tmp_path, max_shard_size="20MB")
    out = subprocess.run([sys.executable, "-c", _PEAK, str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    measured = json.loads(out.stdout)
    terms = dict(shape_of("llama-small", "bfloat16").host_terms("train", True, OptimizerConfig()))
    formula = sum(terms.values())
    host = measured["grown"] - measured["device_pool"]
    assert abs(host - formula) <= 0.10 * formula, (measured, terms)
    # loading alone holds the weights, the master and the gradients; AdamW's moments come with the first step
    at_load = formula - terms["AdamW's two moments in float32"]
    assert abs(measured["loaded"] - at_load) <= 0.10 * at_load, (measured, terms)
