"""`sltune calibrate` (sltune.cli.calibrate): the rates kept in the job store per machine and workload and shown
from it until asked again, a spec's model measured in its dtype, and a bad flag refused in one line before anything
is measured."""

import json

import pytest

from sltune.machine import MachineRates
from sltune.store import Store
from tests.support.cli import sltune


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
