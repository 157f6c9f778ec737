"""Run by tests/integration/test_distributed.py under torchrun: sharded training on each rank's own rows, then the
full parameters (gathered on every rank) and the byte counters, saved by rank 0."""

import json
import sys

import torch
import torch.distributed as dist

from sltune import SpeedLoaderConfig, SpeedLoaderEngine
from sltune.models import build

sys.path.insert(0, ".")
from tests.support.reference import adamw

ROWS_PER_RANK, SEQ = 4, 16
# a unit only partly trainable, whose trainable prefix lands in one rank's shard only
PARTLY_FROZEN = "model.layers.0.input_layernorm"
RUNS = [("llama-tiny", "speedloader", "recompute"), ("gpt2-tiny", "canonical", "recompute"),
        ("frozen", "speedloader", "recompute"), ("llama-tiny", "speedloader", "offload"),
        ("gpt2-tiny", "canonical", "offload"), ("frozen", "speedloader", "offload")]
# bfloat16 with float32 masters, gradients clipped on the global norm over both ranks' shards
MIXED_RUNS = [("llama-tiny", "speedloader", "recompute"), ("gpt2-tiny", "canonical", "offload")]
MAX_GRAD_NORM = 0.05


def freeze_all_but(model, keep: str):
    for name, p in model.named_parameters():
        p.requires_grad_(name.startswith(keep))
    return model


def batch(step: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(3, 512, (ROWS_PER_RANK, SEQ), generator=g)


def main(out: str) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    report = {"world": world, "runs": {}, "io": {}}
    for preset, schedule, acts in RUNS:
        model = freeze_all_but(build("llama-tiny"), PARTLY_FROZEN) if preset == "frozen" else build(preset)
        engine = SpeedLoaderEngine(model, SpeedLoaderConfig(sub_batch_size=2, num_sub_batches=2, num_live_blocks=3,
                                   schedule=schedule, activations=acts, world_size=world), optimizer=adamw)
        losses = [engine.train_step(batch(step, rank)).loss for step in range(2)]
        state = engine.state_dict()                      # every rank gathers
        if rank == 0:
            torch.save(state, f"{out}.{preset}.{schedule}.{acts}.pt")
        report["runs"][f"{preset}/{schedule}/{acts}"] = losses
    for preset, schedule, acts in MIXED_RUNS:
        engine = SpeedLoaderEngine(build(preset), SpeedLoaderConfig(
            sub_batch_size=2, num_sub_batches=2, num_live_blocks=3, schedule=schedule, activations=acts,
            dtype="bfloat16"), optimizer=adamw, max_grad_norm=MAX_GRAD_NORM)
        results = [engine.train_step(batch(step, rank)) for step in range(2)]
        state = engine.state_dict()
        if rank == 0:
            torch.save(state, f"{out}.{preset}.{schedule}.{acts}.mixed.pt")
        report["runs"][f"{preset}/{schedule}/{acts}/mixed"] = {
            "losses": [r.loss for r in results], "norms": [r.grad_norm for r in results]}
        every = [None] * world
        dist.all_gather_object(every, {"io": results[-1].io.as_dict(), "expected": engine.expected_io(SEQ).as_dict()})
        report["io"][f"{schedule}-mixed/2"] = every
    for schedule, acts in (("speedloader", "recompute"), ("canonical", "recompute"), ("speedloader", "offload")):
        for n in (1, 4):
            engine = SpeedLoaderEngine(build("llama-tiny"), SpeedLoaderConfig(sub_batch_size=1, num_sub_batches=n,
                                       num_live_blocks=1, schedule=schedule, activations=acts), optimizer=adamw)
            res = engine.train_step(batch(0, rank)[:n])
            mine = {"io": res.io.as_dict(), "expected": engine.expected_io(SEQ).as_dict(),
                    "shard_bytes": engine.param_bytes}
            every = [None] * world
            dist.all_gather_object(every, mine)          # every rank's counters, not just rank 0's
            report["io"][(schedule if acts == "recompute" else f"{schedule}-{acts}") + f"/{n}"] = every
    write_report(report, out)


def write_report(report: dict, out: str) -> None:
    """Rank 0 writes the report; every rank leaves the process group."""
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(report, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
