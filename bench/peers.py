"""sltune beside the real peers, in one interleaved run: a plain PyTorch accumulation loop, DeepSpeed ZeRO-3 with
parameter and optimizer offload, DeepSpeed ZeRO-2 with optimizer offload, and sltune's schedules x activations.

    python bench/peers.py [--model llama-small] [--b 1] [--seq 32] [--n 8] [--k 1] [--rounds 5]

DeepSpeed is an optional extra (pip install -e '.[peers]'); without it the DeepSpeed rows are skipped, saying
so. It runs on its CPU accelerator (DS_ACCELERATOR=cpu) as one gloo rank, with torch's AdamW (DeepSpeed's own
CPU Adam would be compiled on first use; "zero_force_ds_cpu_optimizer": false lets a torch optimizer run).
NVMe offload needs libaio and is not compared. Every runner starts from the same weights and trains on the
same batches in the same order, so their losses must agree step by step (checked).
"""

from __future__ import annotations

import copy
import os
import socket
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from runtime import (LR, Runner, best_speedloader, check_losses, forced_recompute, interleave,  # noqa: E402
                     plain_loop, report, setup, sltune_runners, targets)


def deepspeed_or_none():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        import deepspeed
    except ImportError:
        print("DeepSpeed is not installed: its rows are skipped (pip install -e '.[peers]' to compare)")
        return None
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "LOCAL_RANK": "0",
                       "WORLD_SIZE": "1"})
    deepspeed.init_distributed("gloo")
    # DeepSpeed 0.19 calls collectives torch 2.13 renamed: one FutureWarning per call would bury the table
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed")
    return deepspeed


def deepspeed_runner(deepspeed, base: torch.nn.Module, b: int, n: int, stage: int, offload_params: bool) -> Runner:
    """DeepSpeed's own gradient accumulation: n micro-batches of b rows per optimizer step."""
    model = copy.deepcopy(base)
    zero = {"stage": stage, "offload_optimizer": {"device": "cpu"}}
    if offload_params:
        zero["offload_param"] = {"device": "cpu"}
    config = {"train_micro_batch_size_per_gpu": b, "gradient_accumulation_steps": n, "zero_optimization": zero,
              "zero_force_ds_cpu_optimizer": False, "steps_per_print": 10**9, "wall_clock_breakdown": False,
              "gradient_clipping": 0.0}       # DeepSpeed clips to norm 1.0 by default; the others do not clip
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=LR),
                                      config=config)

    def step(batch: torch.Tensor) -> float:
        total = 0.0
        for i in range(n):
            mb = batch[i * b:(i + 1) * b]
            loss = engine(input_ids=mb, labels=mb).loss
            engine.backward(loss)          # scaled by 1/n: the mean over the batch
            engine.step()                  # steps the optimizer at the accumulation boundary
            total += loss.item() / n
        return total
    name = "zero3 param+opt offload" if offload_params else f"zero{stage} opt offload"
    return Runner(name, step)


def main() -> None:
    args, base, batches = setup()
    ds = deepspeed_or_none()
    runners = [plain_loop(base, args.b, args.n)]
    if ds is not None:
        print(f"DeepSpeed {ds.__version__} on its {ds.get_accelerator().device_name()} accelerator, 1 gloo rank")
        runners += [deepspeed_runner(ds, base, args.b, args.n, 3, offload_params=True),
                    deepspeed_runner(ds, base, args.b, args.n, 2, offload_params=False)]
    bound = forced_recompute(base, args.b, args.n, args.k)
    runners += ([bound] if bound else []) + sltune_runners(base, args)
    interleave(runners, batches, args.rounds, args.warmup)
    check_losses(runners)
    best = best_speedloader(runners)
    report(runners, args.b * args.n * args.seq,
           targets(best) + [(best, "zero3 param+opt offload", 1.5), (best, "zero2 opt offload", 1.15)])


if __name__ == "__main__":
    main()
