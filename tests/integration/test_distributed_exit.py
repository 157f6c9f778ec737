"""Two gloo ranks that build an engine, step it, destroy the process group and exit: every run exits 0.

What held the group: torch.distributed.nn.functional binds `group=group.WORLD` as default arguments at
import, and transformers imports it (through torch._dynamo) when it builds a model, after the script
has initialised the group. Those defaults kept the gloo group and its threads alive past
destroy_process_group; at exit the threads' std::thread objects died joinable and the process aborted
("terminate called without an active exception") about one run in five. sltune imports that module
before any group exists (sltune/runtime/sharding.py)."""

import os
import re
import subprocess
import sys
from pathlib import Path

from tests.support.servers import free_port

ROOT = Path(__file__).resolve().parents[2]
# The abort came about one run in five; what caused it, gloo threads alive after destroy_process_group, came
# every run, and is asserted below: one run catches a regression for certain.
RUNS = 1
# The 2-rank script, run RUNS times. Each rank is a fork of this launcher, which has imported what the
# script imports before it initialises the group (torch, sltune): the runs skip that import, not the model
# build after init_process_group that brought the bug in. A rank leaves by sys.exit, a normal interpreter
# exit with its finalisation, where the abort happened.
LAUNCHER = """
import os, sys, torch, torch.distributed as dist
from sltune import SpeedLoaderConfig, SpeedLoaderEngine
from sltune.models import build

for run, port in enumerate(sys.argv[1:]):
    ranks = []
    for rank in range(2):
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:
            os.environ.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
            dist.init_process_group("gloo")
            engine = SpeedLoaderEngine(build("llama-tiny"), SpeedLoaderConfig(sub_batch_size=1, num_sub_batches=2),
                                       optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
            engine.train_step(torch.randint(0, 500, (2, 8)))
            dist.destroy_process_group()
            threads = sorted(open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task"))
            print(f"run {run} rank {rank} threads after destroy: {threads}", flush=True)
            sys.exit(0)
        ranks.append(pid)
    for rank, pid in enumerate(ranks):
        print(f"run {run} rank {rank} exit {os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])}", flush=True)
"""


def test_two_ranks_exit_cleanly_after_destroy_process_group_every_time():
    out = subprocess.run([sys.executable, "-c", LAUNCHER, *(str(free_port()) for _ in range(RUNS))], cwd=ROOT,
                         env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    exits = re.findall(r"run \d+ rank \d+ exit -?\d+", out.stdout)     # ranks share the pipe: lines may touch
    assert exits == [f"run {run} rank {rank} exit 0" for run in range(RUNS) for rank in range(2)], \
        out.stdout + out.stderr[-3000:]
    assert "terminate called" not in out.stderr
    # the group is gone once destroyed: no gloo thread outlives it (before the fix, every run kept three)
    destroyed = re.findall(r"threads after destroy: \[[^\]]*\]", out.stdout)
    assert len(destroyed) == 2 * RUNS and not any("gloo" in line for line in destroyed), destroyed
