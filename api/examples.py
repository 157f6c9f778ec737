"""The tuning spec POST /tune shows as its example in /docs and /redoc: the README's, field for field
(tests/test_dashboard.py holds the two together), so "Try it out" sends a spec the server accepts where the
schema alone made up `preset: "string"` and `sub_batch_size: 0`."""

TUNE_EXAMPLE = {
    "name": "tiny-llama-cpu",
    "model": {"preset": "llama-tiny"},
    "workload": {"mode": "train", "seq_len": 128},
    "hardware": {"device": "cpu", "device_memory_limit": "1GiB", "host_memory_limit": "8GiB", "world_size": 1},
    "search": {"strategy": "oneshot", "sub_batch_size": {"min": 1, "max": 16},
               "num_sub_batches": {"min": 1, "max": 16}, "num_live_blocks": {"min": 1, "max": 4},
               "activations": ["recompute", "offload"], "max_trials": 20, "trial_steps": 2,
               "trial_min_time_s": 2.0, "confirm_rounds": 3, "time_budget_s": 600},
    "optimizer": {"name": "adamw", "lr": 1.0e-5},
    "objective": "tokens_per_s",
}
