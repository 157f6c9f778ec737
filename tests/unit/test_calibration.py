"""`sltune calibrate`: this machine's rates at a model's own shapes, each with its spread, within a time budget, kept in
the job store per machine and workload and read back from it."""

import json

import pytest
import torch

from sltune.machine import MachineRates, Workload, calibrate
from sltune.store import Store
from tests.support.cli import sltune

SMALL = Workload(matmuls=((64, 96), (64, 256)), rows=(16, 64), hidden=64, heads=2, head_dim=32, seq_len=16,
                 param_numels=(4096, 64))


def test_every_rate_is_a_median_between_its_slowest_and_fastest_sample(tmp_path):
    rates = calibrate(SMALL, budget_s=2, offload_dir=tmp_path)
    every = ([m.flops for m in rates.matmul] + [a.flops for a in rates.attention] + list(rates.elementwise.values())
             + list(rates.norm.values()) + list(rates.optimizer.values()) + list(rates.copies.values())
             + list(rates.disk.values()) + [rates.op_overhead])
    assert len(every) == 4 + 2 + 1 + 1 + 1 + 1 + 2 + 1
    assert all(r.low <= r.median <= r.high and r.samples >= 3 for r in every)
    assert {(m.rows, m.k, m.n) for m in rates.matmul} == {(16, 64, 96), (64, 64, 96), (16, 64, 256), (64, 64, 256)}
    assert [a.batch for a in rates.attention] == [1, 4]                  # rows / seq_len
    assert set(rates.disk) == {"write", "read"} and set(rates.copies) == {"host"}
    assert not list(tmp_path.iterdir())                                  # the disk probe's folder is gone
    assert MachineRates.model_validate_json(rates.model_dump_json()) == rates


def test_a_matmul_too_slow_for_its_share_of_the_budget_is_timed_on_fewer_rows_and_says_so():
    """4096 x 2048 @ 2048 x 2048 is 34 GFLOP, a third of a second or more on any CPU: a 0.1 s budget cannot hold it,
    so fewer rows are timed and the entry names them, and a second row count cut to the same size is not timed
    twice. The whole takes a warm-up and 3 samples per probe: a second or two, not the full matmul's."""
    rates = calibrate(Workload(matmuls=((2048, 2048),), rows=(2048, 4096), hidden=256, heads=2, head_dim=128,
                               seq_len=64, param_numels=(4096,)), budget_s=0.1)
    (m,) = rates.matmul
    assert 8 <= m.rows < 2048 and (m.k, m.n) == (2048, 2048)
    assert rates.seconds < 10


def test_the_rates_are_the_dtype_s_own():
    """A bfloat16 matmul is not a float32 one (on a CPU without bf16 instructions a hundredth of its rate): the
    workload's dtype is what is timed, and it keys the stored rates apart."""
    bf16 = Workload(matmuls=((64, 64),), rows=(16,), hidden=64, heads=2, head_dim=32, seq_len=16, dtype="bfloat16")
    rates = calibrate(bf16, budget_s=1)
    assert {m.dtype for m in rates.matmul} == {"bfloat16"} and set(rates.norm) == {"bfloat16"}
    assert bf16.key != Workload(**{**bf16.__dict__, "dtype": "float32"}).key


def test_a_missing_rates_file_names_the_command_that_writes_it(tmp_path):
    with pytest.raises(ValueError, match="sltune calibrate --out"):
        MachineRates.load(tmp_path / "rates.json")


def test_calibrate_stores_the_rates_and_shows_them_from_the_store_until_asked_again(tmp_path):
    db = f"sqlite:///{tmp_path / 'jobs.db'}"
    first = sltune("calibrate", "--db", db, "--budget", "2", "--out", str(tmp_path / "rates.json"),
                   "--offload-dir", str(tmp_path))
    assert first.returncode == 0, first.stderr
    assert "measured in" in first.stdout and "GFLOP/s" in first.stdout and "calibrate: disk" in first.stderr
    written = MachineRates.load(tmp_path / "rates.json")
    again = sltune("calibrate", "--db", db, "--json", "--offload-dir", str(tmp_path))
    assert again.returncode == 0 and "calibrate:" not in again.stderr          # nothing measured: from the store
    elsewhere = sltune("calibrate", "--db", db, "--json", "--budget", "1", "--offload-dir", str(tmp_path / "other"))
    assert "calibrate: disk" in elsewhere.stderr                               # another disk folder: measured
    assert MachineRates.model_validate(json.loads(again.stdout)) == written
    fresh = sltune("calibrate", "--db", db, "--json", "--again", "--budget", "1", "--offload-dir", str(tmp_path))
    assert "calibrate: disk" in fresh.stderr
    assert MachineRates.model_validate(json.loads(fresh.stdout)).measured_at > written.measured_at
    assert len(Store(db).all_rates()) == 3


def test_calibrate_with_a_spec_measures_its_model_s_shapes_in_its_dtype(tmp_path):
    spec = tmp_path / "spec.yaml"
    spec.write_text("model: {preset: llama-tiny, dtype: bfloat16}\nworkload: {seq_len: 16}\n"
                    "optimizer: {name: sgd, momentum: 0.9}\nsearch: {sub_batch_size: {min: 1, max: 4}}\n")
    out = sltune("calibrate", str(spec), "--db", f"sqlite:///{tmp_path / 'jobs.db'}", "--json", "--budget", "3",
                 "--offload-dir", str(tmp_path))
    assert out.returncode == 0, out.stderr
    rates = MachineRates.model_validate(json.loads(out.stdout))
    config = __import__("sltune.models", fromlist=["build"]).build("llama-tiny").config
    shapes = {(m.k, m.n) for m in rates.matmul}
    assert {config.hidden_size} == {k for k, n in shapes} - {config.intermediate_size}
    assert {(config.hidden_size, config.vocab_size), (config.hidden_size, config.intermediate_size),
            (config.intermediate_size, config.hidden_size)} <= shapes             # the MLP's up and down
    assert {m.dtype for m in rates.matmul} == {"bfloat16"}
    assert {m.rows for m in rates.matmul} <= {16, 32, 64}                      # b in 1..4 rows of 16 tokens
    assert set(rates.optimizer) == {"torch.sgd"}                                # the spec's, as the runtime steps it


@pytest.mark.parametrize("flags, says", [
    (["--budget", "0"], "--budget must be a positive number of seconds, got 0"),
    (["--budget", "inf"], "--budget must be a positive number of seconds, got inf"),
    (["--ranks", "1"], "--ranks: collectives need 2 to 1024 ranks, got 1"),
    (["--offload-dir", "/proc/nope"], "--offload-dir /proc/nope: not writable"),
])
def test_a_bad_flag_is_one_line_naming_it_before_anything_is_measured(tmp_path, flags, says):
    out = sltune("calibrate", "--db", f"sqlite:///{tmp_path / 'jobs.db'}", *flags)
    assert out.returncode == 2 and says in out.stderr and "calibrate: matmuls" not in out.stderr, out.stderr
