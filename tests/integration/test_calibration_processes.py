"""What `sltune calibrate` times in processes of their own: the collectives over ranks started from the fork server,
and DeepSpeedCPUAdam in a process that imports DeepSpeed."""

import json
import time

import pytest

from sltune.machine import MachineRates, Workload, calibrate
from sltune.profiling import forks
from tests.support.cli import sltune
from tests.support.deepspeed import needs_deepspeed

SMALL = Workload(matmuls=((64, 96),), rows=(16,), hidden=64, heads=2, head_dim=32, seq_len=16)


def test_all_gather_and_reduce_scatter_over_two_ranks_are_timed_with_their_spread():
    rates = calibrate(SMALL, budget_s=4, world_sizes=(2,), processes=forks.context())
    assert set(rates.collectives) == {"all_gather.2", "reduce_scatter.2"} and rates.collective_backend == "gloo"
    assert all(r.low <= r.median <= r.high and r.samples >= 3 and r.unit == "bytes"
               for r in rates.collectives.values())


def test_a_rank_that_fails_is_one_error_naming_it_at_once():
    """Ranks asked for a GPU this machine lacks fail in their first line: the error names the rank and the cause,
    in seconds, not after the collectives' timeout."""
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"2-rank collectives failed: rank \d: "):
        from sltune.machine.collectives import collectives

        collectives(2, "cuda", 1.0, forks.context())
    assert time.monotonic() - start < 60


@needs_deepspeed
def test_a_spec_searching_deepspeed_times_deepspeed_s_cpu_adam_beside_torch_s(tmp_path):
    spec = tmp_path / "spec.yaml"
    spec.write_text("model: {preset: llama-tiny}\nworkload: {seq_len: 16}\nhardware: {world_size: 2}\n"
                    "search: {backend: [speedloader, deepspeed], sub_batch_size: {min: 1, max: 2}}\n")
    out = sltune("calibrate", str(spec), "--db", f"sqlite:///{tmp_path / 'jobs.db'}", "--json", "--budget", "6",
                 "--offload-dir", str(tmp_path), process=True)
    assert out.returncode == 0, out.stderr[-3000:]
    rates = MachineRates.model_validate(json.loads(out.stdout))
    assert set(rates.optimizer) == {"torch.adamw", "deepspeed.cpu_adam"}
    assert set(rates.collectives) == {"all_gather.2", "reduce_scatter.2"}       # hardware.world_size's ranks
