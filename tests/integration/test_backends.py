"""Backends (issue #33): a trial runs SpeedLoader, DeepSpeed or FSDP2 through the same measuring code, and every
trial's step-1 loss is held to plain PyTorch's on the same weights and batch (parity; diverged when it is off)."""

import json

import pytest

from sltune.profiling import SLICES, TrialResult, run_trial
from sltune.profiling.schema import TrialSpec
from tests.support.cli import sltune
from tests.support.deepspeed import needs_deepspeed

TINY = {"model": "llama-tiny", "seq_len": 32, "sub_batch_size": 2, "num_sub_batches": 2, "steps": 2, "min_time_s": 0,
        "remeasure": 0, "timeout_s": 300}


def trial(**kw) -> TrialResult:
    return run_trial({**TINY, **kw})


def assert_measured_and_correct(r: TrialResult) -> None:
    """ok, throughput with its interval, measured peaks, a breakdown summing to one, and parity."""
    assert r.status == "ok", r.error
    assert r.tokens_per_s > 0 and r.timing.tokens_per_s_ci95[0] <= r.tokens_per_s <= r.timing.tokens_per_s_ci95[1]
    assert r.peak_device_bytes > 0 and r.peak_host_bytes > 0
    fractions = r.breakdown.model_dump()
    assert set(fractions) == set(SLICES) and sum(fractions.values()) == pytest.approx(1.0, abs=1e-9)
    assert fractions["compute"] > 0.05, fractions
    p = r.parity
    assert p.ok and p.rel_diff <= p.tolerance and p.loss == pytest.approx(p.reference_loss, rel=p.tolerance)


@needs_deepspeed
def test_deepspeed_zero2_from_the_cli_is_a_trial_result_with_parity(tmp_path):
    """The real deepspeed.initialize on its CPU accelerator over gloo, ZeRO-2 with the optimizer in host memory;
    stdout stays the JSON (DeepSpeed prints as it sets up) and the trace opens in Perfetto."""
    trace = tmp_path / "trace.json"
    out = sltune("profile", "--backend", "deepspeed", "--zero-stage", "2", "--offload-optimizer", "cpu",
                 "--sub-batch-size", "2", "--num-sub-batches", "2", "--seq-len", "32", "--steps", "2",
                 "--min-time", "0", "--trace", str(trace), "--json", process=True)
    assert out.returncode == 0, out.stderr[-3000:]
    data = json.loads(out.stdout)
    r = TrialResult.model_validate(data)
    assert_measured_and_correct(r)
    assert {k: data["config"][k] for k in ("backend", "zero_stage", "offload_optimizer", "offload_param")} == \
        {"backend": "deepspeed", "zero_stage": 2, "offload_optimizer": "cpu", "offload_param": "none"}
    assert data["config"]["num_live_blocks"] is None and "cpu_offload" not in data["config"]   # not its knobs
    # the offloaded optimizer: DeepSpeed's CPU Adam when its op loads, else torch's, saying why
    assert r.backend_detail["optimizer"] == "DeepSpeedCPUAdam" or \
        r.backend_detail["optimizer"].startswith("torch.optim.AdamW; DeepSpeedCPUAdam not used: ")
    assert r.backend_detail["precision"] == "fp32"
    events = json.loads(trace.read_text())["traceEvents"]
    assert any(e.get("name") == "sltune.step" for e in events)


@needs_deepspeed
def test_deepspeed_zero3_with_offloaded_parameters_in_bfloat16():
    r = trial(backend="deepspeed", zero_stage=3, offload_param="cpu", dtype="bfloat16")
    assert_measured_and_correct(r)
    assert (r.config.zero_stage, r.config.offload_param, r.config.offload_optimizer) == (3, "cpu", "none")
    assert r.backend_detail["precision"] == "bf16"
    assert r.parity.tolerance > 1e-3        # bfloat16's, not float32's


def test_fsdp2_on_two_ranks_attributes_its_collectives():
    """fully_shard per decoder layer over a 2-rank CPU mesh (gloo), through the multi-rank trial machinery: the
    all-gathers and reduce-scatters FSDP2 issues inside the labelled phases get their own slices."""
    r = trial(backend="fsdp", world_size=2, cpu_threads=1)
    assert_measured_and_correct(r)
    assert r.config.backend == "fsdp" and r.config.cpu_offload is False and r.config.reshard_after_forward is True
    assert len(r.ranks) == 2
    assert r.breakdown.all_gather > 0 and r.breakdown.reduce_scatter > 0, r.breakdown
    assert r.backend_detail["mesh"] == "cpu x2 (gloo)"


def test_a_backend_with_a_wrong_loss_scale_is_diverged(monkeypatch):
    """The trial body in this process, FSDP2 with its CPU offload: right, it is ok; with each micro-batch's loss
    doubled (a wrong accumulation scale, injected through the tests' knob) its figures are kept but the status is
    diverged, naming both losses."""
    from sltune.backends.base import LOSS_SCALE_FAULT_ENV
    from sltune.profiling import child

    monkeypatch.setattr(child, "forget_fork_server_heap", lambda: None)
    spec = TrialSpec(**{**TINY, "steps": 1, "profile": False, "backend": "fsdp", "cpu_offload": True,
                        "dtype": "bfloat16"})
    right = TrialResult.model_validate(child.run(spec))
    assert right.status == "ok" and right.parity.ok
    monkeypatch.setenv(LOSS_SCALE_FAULT_ENV, "2")
    wrong = TrialResult.model_validate(child.run(spec))
    assert wrong.status == "diverged" and not wrong.parity.ok
    assert wrong.parity.rel_diff == pytest.approx(1.0, rel=0.02)       # twice the reference
    assert wrong.parity.reference_loss == pytest.approx(right.parity.reference_loss, rel=1e-6)
    assert "step-1 loss" in wrong.error and "plain PyTorch" in wrong.error
    assert wrong.tokens_per_s > 0           # measured all the same


def test_a_speedloader_trial_reads_as_before_plus_its_backend_and_parity():
    r = trial(profile=False)
    data = json.loads(r.model_dump_json())
    assert data["config"] == {"sub_batch_size": 2, "num_sub_batches": 2, "num_live_blocks": 1,
                              "schedule": "speedloader", "activations": "recompute", "seq_len": 32, "world_size": 1,
                              "kv_cache": None, "weights_on_device": None, "optimizer_offload": "host",
                              "num_layers": 4, "backend": "speedloader"}
    assert "backend_detail" not in data
    assert r.status == "ok" and r.parity.ok and r.parity.rel_diff < 1e-6    # float32 on one CPU: the same sums
    assert r.loss != r.parity.loss          # the last timed step's loss, after updates; parity's is step 1's


@pytest.mark.parametrize("fields, named", [
    ({"zero_stage": 3}, "zero_stage: a deepspeed knob; add backend deepspeed"),
    ({"backend": "deepspeed", "offload_param": "cpu"},
     "offload_param: cpu offloads ZeRO-3's parameter partitions; set zero_stage 3"),
    ({"backend": "deepspeed", "zero_stage": 3, "offload_param": "nvme"},
     "offload_param: nvme swaps to files under offload_dir; give offload_dir"),
    ({"backend": "deepspeed", "cpu_offload": True}, "cpu_offload: an fsdp knob; add backend fsdp"),
    ({"backend": "fsdp", "num_live_blocks": 2}, "num_live_blocks: 2 is SpeedLoader's; backend fsdp runs"),
    ({"backend": "fsdp", "dtype": "float16"}, "dtype: float16 needs loss scaling"),
    ({"backend": "fsdp", "mode": "generate"}, "mode: 'generate' is SpeedLoader's"),
])
def test_bad_knobs_are_refused_naming_the_field(fields, named):
    with pytest.raises(ValueError, match=named.replace("(", r"\(")):
        TrialSpec(**fields)


def test_the_cli_refuses_a_knob_in_one_line_naming_its_flag():
    out = sltune("profile", "--backend", "deepspeed", "--offload-param", "cpu", "--steps", "1")
    assert out.returncode == 2 and out.stdout == "" and out.stderr.count("\n") == 1, out.stderr
    assert "--offload-param: cpu offloads ZeRO-3's parameter partitions; set --zero-stage 3" in out.stderr
    out = sltune("profile", "--cpu-offload", "--steps", "1")
    assert out.returncode == 2 and out.stderr == ("sltune profile: error: --cpu-offload: an fsdp knob; add --backend "
                                                  "fsdp, or drop --cpu-offload (--backend speedloader has none of "
                                                  "these knobs)\n")


def test_a_backends_knobs_default_and_reach_the_config():
    spec = TrialSpec(backend="deepspeed")
    assert (spec.zero_stage, spec.offload_optimizer, spec.offload_param) == (2, "none", "none")
    assert TrialSpec(backend="fsdp").knobs()["reshard_after_forward"] is True
    assert "zero_stage" not in TrialSpec().knobs()


@needs_deepspeed
def test_deepspeed_s_cpu_adam_asks_py_cpuinfo_once_a_machine(tmp_path, monkeypatch):
    """DeepSpeedCPUAdam asks py-cpuinfo for the CPU's vendor each time one is built, and py-cpuinfo answers from a
    Python of its own that busy-waits a second on the clock: 1.3 s and 1.3 s of CPU in every rank of every trial
    that offloads the optimizer. Asked once, the answer is kept per CPU beside DeepSpeed's ops."""
    import resource

    import cpuinfo
    import torch

    from sltune.backends.deepspeed import import_deepspeed
    from sltune.backends.deepspeed_ops import cpu_info_file, missing

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    import_deepspeed("cpu")

    def asked() -> tuple[dict, float]:
        """py-cpuinfo's answer as DeepSpeed asks it, and the CPU seconds of the processes that took to answer."""
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        from cpuinfo import get_cpu_info              # as DeepSpeedCPUAdam.__init__ imports it

        info = get_cpu_info()
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        return info, after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime

    first, cpu_first = asked()
    assert first["vendor_id_raw"] and cpu_first > 0.1                      # py-cpuinfo's own process, this once
    kept = cpu_info_file()
    assert kept.parent == tmp_path and json.loads(kept.read_text()) == first
    again, cpu_again = asked()
    assert again == first and cpu_again == pytest.approx(0.0, abs=1e-6)       # no process of its own
    if not missing(["cpu_adam"], "cpu"):              # built at install (scripts/install.sh): never compiled here
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_utime
        DeepSpeedCPUAdam([torch.nn.Parameter(torch.zeros(4))])
        assert resource.getrusage(resource.RUSAGE_CHILDREN).ru_utime == before
    assert getattr(cpuinfo.get_cpu_info, "remembered", False)
