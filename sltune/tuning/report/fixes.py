"""What to change when a tuning job's trial gave no throughput: one line per kind of failure, naming the tuning spec's
fields. A trial's own error names the trial's settings (timeout_s, device_memory_limit, num_live_blocks even under
FSDP), which a user of `sltune tune` sets elsewhere or not at all; the trial page shows this line beside it."""

from __future__ import annotations

# what lowers each backend's device memory, as the spec's search section names it
DEVICE_KNOBS = {"speedloader": "search.sub_batch_size or search.num_live_blocks",
                "deepspeed": "search.sub_batch_size, or let search.deepspeed sweep zero_stage 3 and offload_optimizer "
                             "or offload_param cpu",
                "fsdp": "search.sub_batch_size, or let search.fsdp sweep cpu_offload true"}
SEARCH_FINDS_LIMITS = ("An oom trial is the search finding where the limit lies: the job needs a change only if no "
                       "config fits. ")


def fix_of(status: str, backend: str = "speedloader", oom_resource: str | None = None,
           error: str | None = None) -> str | None:
    """The spec change for a trial that ended `status`; None for an ok trial, or a failure whose fix only its own
    error can say (an exception in the trial)."""
    if status == "oom" and oom_resource == "host":
        offload = (", or let search.optimizer_offload (and param_offload) include disk"
                   if backend == "speedloader" else "")
        return (SEARCH_FINDS_LIMITS + "Lower search.sub_batch_size or search.num_sub_batches" + offload
                + ", or raise hardware.host_memory_limit if the machine has the memory.")
    if status == "oom":
        return (SEARCH_FINDS_LIMITS + f"Lower {DEVICE_KNOBS.get(backend, 'search.sub_batch_size')}, or raise "
                "hardware.device_memory_limit if the device has the memory.")
    if status == "timeout":
        return ("Raise search.trial_timeout_s, or time fewer steps (search.trial_steps, search.trial_min_time_s); a "
                "larger config than this one will take longer still.")
    if status == "diverged":
        return ("Its step-1 loss is not plain PyTorch's, so the tuner never picks it and its tokens/s is no "
                "throughput. No spec field makes it train correctly: leave this config out of the search (search."
                f"{'backend' if backend == 'speedloader' else backend}) and report it with this page's config and "
                "parity.")
    if status == "interrupted":
        return "The job stopped while this trial ran (a cancel, or its worker stopped); resuming the job runs it again."
    if status == "failed" and error and "not installed" in error:
        return "Install what the error names (docs/guides/tuning.md), or leave that backend out of search.backend."
    return None
