"""A best.yaml as a tuning job exports it, for the tests of the commands that read one."""

from sltune import SpeedLoaderConfig


def tuned_file(path):
    """A best.yaml as a job exports it: knobs, then the workload and model it was tuned on."""
    SpeedLoaderConfig(sub_batch_size=2, num_sub_batches=2, num_live_blocks=1, dtype="bfloat16").to_yaml(
        path, workload={"mode": "train", "seq_len": 16, "world_size": 1},
        provenance={"job_id": "j", "model": {"preset": "gpt2-tiny", "dtype": "bfloat16"}})
    return path
