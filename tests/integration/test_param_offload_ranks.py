"""param_offload disk over 2 gloo ranks: each rank's shard of each unit's dtype copy is a file of its own folder,
read ahead into a window before the all-gather, its gradient shards lent by a GradWindow. Training equals
param_offload host to the bit (bf16 mixed and fp32, clipping, tied embeddings, a resume from a checkpoint); each
rank's counters follow the formula (a unit whose trainable prefix is all in rank 0's shard included); each rank's
window holds a few units' shards, not all of them."""

import json

from sltune import SpeedLoaderConfig
from sltune.profiling.schema import TrialSpec
from tests.support.distributed import torchrun


def test_two_ranks_disk_weights_equal_host_weights_bit_for_bit(tmp_path):
    out = tmp_path / "report.json"
    r = torchrun("tests/support/disk_dist_script.py", str(out), "params", timeout=240)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    report = json.loads(out.read_text())
    window = report.pop("window")
    assert len(report) == 4
    for key, run in report.items():
        assert run["losses"][0] == run["losses"][1], key
        assert len(set(run["losses"][0])) > 1, key                      # the weights did move
        assert run["norms"][0] == run["norms"][1], key
        assert run["weights_equal"], key
        folders = set()
        for rank in run["ranks"]:
            assert rank["copies_equal"] and rank["placeholders"], key  # its dtype shards, from its files
            assert rank["io"] == rank["expected"], key                 # the weights' files counted per rank
            assert rank["io"]["allgather_bytes"] > 0 and rank["io"]["disk_read_bytes"] > 0, key
            assert rank["files"] == run["units"], key                  # one committed version per unit
            folders.add(rank["folder"])
        assert len(folders) == 2, key                                   # each rank its own folder
    assert report["llama-tiny/bfloat16/recompute/None/2"]["early"]
    assert not report["llama-tiny-tied/bfloat16/offload/0.05/None"]["early"]
    # measured on each rank: the window's peak (buffers read ahead, being copied, stepped, written behind, spare)
    # is a few units' shards, not all of them; between steps nothing of the weights stays in host memory; the
    # gradient shards borrowed within the two largest, not all of them
    for rank in window:
        assert rank["units"] == 18
        assert 0 < rank["peak_window_bytes"] and rank["peak_window_bytes"] * 2 < rank["shard_bytes"], rank
        assert rank["window_bytes_now"] <= rank["peak_window_bytes"]
        assert rank["held_between_steps"] <= 2 * rank["units"]
        assert 0 < rank["grad_peak_bytes"] <= rank["grad_budget"] < rank["grad_shard_bytes"] / 4, rank
        assert rank["folder_gone_at_del"]


def test_param_offload_disk_is_accepted_over_several_ranks(tmp_path):
    """No more one-rank refusal; training still needs the optimizer on disk."""
    cfg = SpeedLoaderConfig(param_offload="disk", optimizer_offload="disk", offload_dir=str(tmp_path), world_size=2)
    assert cfg.world_size == 2
    spec = TrialSpec(model="llama-tiny", param_offload="disk", optimizer_offload="disk", offload_dir=str(tmp_path),
                     world_size=2)
    assert spec.knobs()["param_offload"] == "disk" and spec.world_size == 2
