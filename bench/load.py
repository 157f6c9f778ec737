"""Host memory of loading a Hugging Face checkpoint to train it, against the documented formula.

Saves a preset's shape with random weights as a bf16 checkpoint (sharded like transformers does), then, in a
fresh process per round, loads it with `SpeedLoaderEngine.from_pretrained` for bf16 mixed-precision AdamW and
takes one step. It prints the resident growth over the process's baseline (its imports included) at load and
after the step (less the device buffers the engine's pool holds: on the CPU the device is the same memory),
beside the formula's terms (sltune.tuning.cost.shape host_terms), and the load time.

    python bench/load.py                          # qwen2-0.5b shape, 3 rounds
    python bench/load.py --model llama-small --rounds 5
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

_ROUND = textwrap.dedent("""
    import json, sys, time
    import torch
    from sltune import SpeedLoaderConfig, SpeedLoaderEngine
    from sltune.models.checkpoint import Checkpoint
    from sltune.profiling.child import forget_fork_server_heap, resident_bytes
    from sltune.training import OptimizerConfig
    Checkpoint(sys.argv[1]).empty_model()
    forget_fork_server_heap()
    before = resident_bytes()
    start = time.perf_counter()
    engine = SpeedLoaderEngine.from_pretrained(sys.argv[1], SpeedLoaderConfig(dtype="bfloat16"),
                                               optimizer=OptimizerConfig().factory)
    load_s = time.perf_counter() - start
    loaded = resident_bytes(peak=True) - before
    engine.train_step(torch.randint(3, 100, (1, 16)))
    print(json.dumps({"load_s": load_s, "loaded": loaded, "grown": resident_bytes(peak=True) - before,
                      "device_pool": engine.pool.held_bytes, "baseline": before}))
""")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2-0.5b", help="a preset shape")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--shard", default="500MB", help="max_shard_size of the saved checkpoint")
    parser.add_argument("--dir", help="where to save the checkpoint (default: a temporary folder)")
    args = parser.parse_args()

    import torch

    from sltune.models import build
    from sltune.tuning.cost.shape import shape_of
    from sltune.training import OptimizerConfig

    shape = shape_of(args.model, "bfloat16")
    folder = Path(args.dir or tempfile.mkdtemp(prefix="sltune-load-"))
    free = shutil.disk_usage(folder).free
    if free < 2 * shape.param_bytes:
        sys.exit(f"skipped: {free / 2**30:.1f} GiB free at {folder}, the checkpoint needs "
                 f"{shape.param_bytes / 2**30:.1f} GiB; pass --dir on a larger disk")
    start = time.perf_counter()
    build(args.model, seed=0, dtype=torch.bfloat16).save_pretrained(folder, max_shard_size=args.shard)
    print(f"{args.model}: {shape.param_bytes / 2 / 1e6:.0f}M parameters, saved as bf16 to {folder} in "
          f"{time.perf_counter() - start:.0f}s ({len(list(folder.glob('*.safetensors')))} shards of <= {args.shard})")
    terms = dict(shape.host_terms("train", True, OptimizerConfig()))
    formula = sum(terms.values())
    at_load = formula - terms["AdamW's two moments in float32"]
    for what, size in terms.items():
        print(f"  {what:34s} {size / 2**30:7.3f} GiB")
    print(f"  {'formula':34s} {formula / 2**30:7.3f} GiB (at load, before AdamW's state: {at_load / 2**30:.3f})")
    rounds = []
    try:
        for r in range(args.rounds):
            out = subprocess.run([sys.executable, "-c", _ROUND, str(folder)], capture_output=True, text=True,
                                 cwd=ROOT, check=True)
            m = json.loads(out.stdout)
            host = m["grown"] - m["device_pool"]
            rounds.append((m["loaded"] / at_load, host / formula, m["load_s"]))
            print(f"round {r + 1}: baseline {m['baseline'] / 2**30:.2f} GiB; at load +{m['loaded'] / 2**30:.3f} GiB "
                  f"({m['loaded'] / at_load:.3f}x); after a step +{m['grown'] / 2**30:.3f} GiB, less the device "
                  f"pool's {m['device_pool'] / 2**30:.3f}: {host / 2**30:.3f} GiB ({host / formula:.3f}x the "
                  f"formula); load {m['load_s']:.1f}s")
    finally:
        if not args.dir:
            shutil.rmtree(folder, ignore_errors=True)
    for i, what in enumerate(("at load / formula", "after a step / formula", "load seconds")):
        values = [r[i] for r in rounds]
        print(f"{what:24s} median {statistics.median(values):.3f} (min {min(values):.3f}, max {max(values):.3f})")


if __name__ == "__main__":
    main()
