"""Run by tests/integration/test_disk_tier.py under torchrun: each config trained with optimizer_offload host and
disk on 2 gloo ranks (each rank its own rows, its own shard of every unit's masters and moments); rank 0 reports
whether losses, gradient norms and the gathered masters are equal bit for bit, and each rank's counters."""

import sys
import tempfile

import torch
import torch.distributed as dist

from sltune import SpeedLoaderConfig, SpeedLoaderEngine
from sltune.models import build

sys.path.insert(0, ".")
from tests.support.dist_script import write_report
from tests.support.reference import adamw

# stepped during the backward; and after it (clipping on the global norm over both ranks)
RUNS = [("llama-tiny", "recompute", None), ("qwen2-tiny", "offload", 0.05)]
STEPS, SEQ = 5, 16


def train(preset: str, acts: str, clip: float | None, offload: str, rank: int, folder: str):
    cfg = SpeedLoaderConfig(sub_batch_size=2, num_sub_batches=2, num_live_blocks=2, activations=acts,
                            dtype="bfloat16", optimizer_offload=offload,
                            offload_dir=folder if offload == "disk" else None)
    engine = SpeedLoaderEngine(build(preset, seed=0), cfg, optimizer=adamw, max_grad_norm=clip, track_grad_norm=True)
    results = []
    for step in range(STEPS):
        ids = torch.randint(3, 512, (4, SEQ), generator=torch.Generator().manual_seed(100 * step + rank))
        results.append(engine.train_step(ids))
    return engine, results


def main(out: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    report = {}
    with tempfile.TemporaryDirectory() as folder:
        for preset, acts, clip in RUNS:
            host, host_res = train(preset, acts, clip, "host", rank, folder)
            disk, disk_res = train(preset, acts, clip, "disk", rank, folder)
            a, b = host.state_dict(), disk.state_dict()           # every rank gathers
            every = [None] * dist.get_world_size()
            dist.all_gather_object(every, {"io": disk_res[-1].io.as_dict(),
                                           "expected": disk.expected_io(SEQ).as_dict()})
            report[f"{preset}/{acts}/{clip}"] = {
                "losses": [[r.loss for r in host_res], [r.loss for r in disk_res]],
                "norms": [[r.grad_norm for r in host_res], [r.grad_norm for r in disk_res]],
                "weights_equal": all(torch.equal(a[k], b[k]) for k in a), "io": every,
                "early": disk.last_stepping.early}
    write_report(report, out)


if __name__ == "__main__":
    main(sys.argv[1])
