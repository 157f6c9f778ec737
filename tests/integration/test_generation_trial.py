"""A generation trial in its own process reports throughput, traffic and its time breakdown."""

import pytest

from sltune.profiling import run_trial


def test_generation_trial_reports_throughput_traffic_and_breakdown():
    result = run_trial({"model": "llama-tiny", "mode": "generate", "sub_batch_size": 2, "num_sub_batches": 2,
                        "prompt_len": 8, "new_tokens": 4, "steps": 1, "min_time_s": 0, "timeout_s": 120})
    assert result.status == "ok", result.error
    assert result.tokens_per_s > 0 and result.step_seconds > 0
    assert result.config.seq_len == 12
    assert result.config.kv_cache == "host"
    assert result.io.param_load_bytes > 0 and result.io.kv_offload_bytes > 0 and result.io.kv_load_bytes == 0
    assert result.peak_device_bytes > 0
    assert sum(result.breakdown.model_dump().values()) == pytest.approx(1.0, abs=1e-9)
    assert result.breakdown.compute > 0 and result.breakdown.memcpy > 0
