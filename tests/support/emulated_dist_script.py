"""Run by tests/integration/test_emulated_device_ranks.py under torchrun on the emulated device: sharded
training on each rank's own rows, and the sharded prefetch timed while the other rank is late."""

import json
import sys
import time

import torch
import torch.distributed as dist

from sltune import SpeedLoaderConfig, SpeedLoaderEngine
from sltune.models import build

sys.path.insert(0, ".")
from tests.support.dist_script import batch
from tests.support.reference import adamw

LATE = 1.0     # seconds rank 1 waits before joining the all-gather


def engine(schedule: str) -> SpeedLoaderEngine:
    return SpeedLoaderEngine(build("llama-tiny"), SpeedLoaderConfig(sub_batch_size=2, num_sub_batches=2,
                             num_live_blocks=3, schedule=schedule), optimizer=adamw)


def main(out: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    report = {"runs": {}}
    for schedule in ("speedloader", "canonical"):
        eng = engine(schedule)
        report["runs"][schedule] = [eng.train_step(batch(0, rank)).loss]
        state = eng.state_dict()
        if rank == 0:
            torch.save(state, f"{out}.{schedule}.pt")

    # the prefetch must not block on the gather: rank 0 gets on with its work while rank 1 is late
    eng = engine("speedloader")
    unit = eng.groups[0].unit
    if rank == 1:
        time.sleep(LATE)
    start = time.perf_counter()
    eng.params.prefetch(unit)
    issued = time.perf_counter() - start
    eng.params.activate(unit)
    ready = time.perf_counter() - start
    names = {id(p): n for n, p in eng.model.named_parameters()}
    reference = build("llama-tiny").state_dict()
    gathered = all(torch.equal(p.data, reference[names[id(p)]]) for p in unit.params)
    eng.params.release(unit)
    if rank == 0:
        report.update(issued=issued, ready=ready, gathered=gathered)
        with open(out, "w") as f:
            json.dump(report, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
