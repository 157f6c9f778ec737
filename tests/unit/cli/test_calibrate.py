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
    spec.write_text("model: {preset: llama-tiny, dtype: bfloat16}\nworkload: {seq_len: 24}\n"
                    "optimizer: {name: sgd, momentum: 0.9}\nsearch: {sub_batch_size: {min: 1, max: 4}}\n")
    out = sltune("calibrate", str(spec), "--db", f"sqlite:///{tmp_path / 'jobs.db'}", "--json", "--budget", "3",
                 "--offload-dir", str(tmp_path))
    assert out.returncode == 0, out.stderr
    rates = MachineRates.model_validate(json.loads(out.stdout))
    config = __import__("sltune.models", fromlist=["build"]).build("llama-tiny").config
    rows = {24, 48, 96}                                                       # b in 1..4 rows of 24 tokens
    forward = [m for m in rates.matmul if m.k not in rows]
    shapes = {(m.k, m.n) for m in forward}
    assert {config.hidden_size} == {k for k, n in shapes} - {config.intermediate_size}
    assert {(config.hidden_size, config.vocab_size), (config.hidden_size, config.intermediate_size),
            (config.intermediate_size, config.hidden_size)} <= shapes             # the MLP's up and down
    assert {m.dtype for m in rates.matmul} == {"bfloat16"}
    # each at the spec's rows, or on fewer (8, 16, 32, ...) where the whole was too slow for its share of the budget
    assert all(m.rows in rows or (8 <= m.rows < max(rows) and m.rows & (m.rows - 1) == 0) for m in forward)
    # each weight's gradient: (out x rows) @ (rows x in), its reduction over the rows
    # (cut to fewer of the out width where too slow, as the forward's rows are)
    grads = [m for m in rates.matmul if m.k in rows]
    assert {m.n for m in grads} == {k for k, n in shapes} and {m.k for m in grads} == rows
    assert all(any(m.n == k and m.rows <= n for k, n in shapes) for m in grads)
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


def test_plan_predicts_step_times_from_the_rates_calibrate_stored_or_from_another_machine_s_file(tmp_path):
    """The rates `calibrate SPEC` stored for this machine give `plan SPEC` each config's predicted step time,
    tokens/s and breakdown, and its pick; --machine reads another machine's file (a what-if: a GPU's copies overlap
    compute); without rates plan says how to get them and predicts no speed."""
    spec = tmp_path / "spec.yaml"
    spec.write_text("model: {preset: llama-tiny}\nworkload: {seq_len: 16}\n"
                    "search: {sub_batch_size: [1, 4], num_sub_batches: [1, 2], num_live_blocks: [1, 2]}\n")
    db, env = f"sqlite:///{tmp_path / 'jobs.db'}", {"SLTUNE_DATA_DIR": str(tmp_path / "data")}
    before = sltune("plan", str(spec), "--db", db, env=env)
    assert before.returncode == 0 and "no step times: no rates for this spec's shapes" in before.stdout
    assert "tokens/s" not in before.stdout
    made = sltune("calibrate", str(spec), "--db", db, "--budget", "3", "--offload-dir", str(tmp_path),
                  "--out", str(tmp_path / "rates.json"))
    assert made.returncode == 0, made.stderr
    out = sltune("plan", str(spec), "--db", db, "--json", env=env)
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout)
    assert r["rates"]["from"].startswith("this machine's rates, calibrated")
    for row in r["configs"]:
        assert row["predicted_step_s"] > 0 and row["predicted_tokens_per_s"] == pytest.approx(
            row["config"]["sub_batch_size"] * row["config"]["num_sub_batches"] * 16 / row["predicted_step_s"])
        fastest, slowest = row["predicted_step_s_interval"]
        assert fastest <= row["predicted_step_s"] <= slowest
        assert sum(row["predicted_breakdown"].values()) == pytest.approx(1.0)
    best = max((row for row in r["configs"] if row["fits"]), key=lambda row: row["predicted_tokens_per_s"])
    assert r["pick"]["config"] == best["config"]
    # another machine's rates: the same file said to be a GPU's, whose copy stream hides copies under compute
    gpu = MachineRates.load(tmp_path / "rates.json")
    gpu = gpu.model_copy(update={"device": "cuda", "copies": {"h2d.pinned": gpu.copies["host"],
                                                              "d2h.pinned": gpu.copies["host"]}})
    gpu.save(tmp_path / "gpu.json")
    what_if = sltune("plan", str(spec), "--machine", str(tmp_path / "gpu.json"), env=env)
    assert what_if.returncode == 0, what_if.stderr
    assert f"step times predicted from {tmp_path / 'gpu.json'} (a prediction from given rates)" in what_if.stdout
    assert "pick (predicted fastest that fits): " in what_if.stdout
    as_json = json.loads(sltune("plan", str(spec), "--machine", str(tmp_path / "gpu.json"), "--json", env=env).stdout)
    for cpu, other in zip(r["configs"], as_json["configs"]):
        assert other["predicted_breakdown"]["memcpy"] < cpu["predicted_breakdown"]["memcpy"]
    missing = sltune("plan", str(spec), "--machine", str(tmp_path / "none.json"), env=env)
    assert missing.returncode == 2 and "sltune calibrate --out" in missing.stderr
    # rates that lack a kind of work the spec does (collectives over its two ranks): said once, the rest planned
    ranks = tmp_path / "ranks.yaml"
    ranks.write_text(spec.read_text() + "hardware: {world_size: 2}\n")
    lacking = sltune("plan", str(ranks), "--machine", str(tmp_path / "rates.json"), env=env)
    assert lacking.returncode == 0, lacking.stderr
    assert "some configs have no step time: the rates hold no all_gather over 2 ranks; calibrate with --ranks 2" \
        in lacking.stdout and ", no step time  fits" in lacking.stdout and "pick (" not in lacking.stdout


def test_the_example_gpu_server_s_rates_are_their_script_s_and_plan_a_what_if_there(tmp_path, monkeypatch):
    """examples/rates/a100-pcie4-nvme.json is what make_a100.py writes (its figures' sources in the README beside
    it), and `plan --machine` predicts the example spec on it, saying the rates are given, not measured."""
    import runpy
    from pathlib import Path

    folder = Path(__file__).resolve().parents[3] / "examples" / "rates"
    monkeypatch.setattr("sys.argv", ["make_a100.py", str(tmp_path / "a100.json")])
    runpy.run_path(str(folder / "make_a100.py"), run_name="__main__")
    assert (tmp_path / "a100.json").read_bytes() == (folder / "a100-pcie4-nvme.json").read_bytes()
    rates = MachineRates.load(folder / "a100-pcie4-nvme.json")
    assert rates.device == "cuda:0" and "published figures" in rates.fingerprint.cpu
    spec = folder.parent / "tiny-llama-cpu.yaml"
    out = sltune("plan", str(spec), "--machine", str(folder / "a100-pcie4-nvme.json"), "--json",
                 env={"SLTUNE_DATA_DIR": str(tmp_path / "data")})
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout)
    assert r["rates"]["from"].endswith("(a prediction from given rates)") and r["rates"]["missing"] is None
    assert all(row["predicted_tokens_per_s"] > 0 for row in r["configs"]) and r["pick"] is not None
