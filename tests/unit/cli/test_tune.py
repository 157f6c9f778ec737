"""`sltune tune` and `sltune plan` (sltune.cli.tune): a bad spec or flag refused in one line before any trial, and
plan's report of a spec's configs before any trial."""

from sltune.cli.main import main
from tests.support.cli import sltune
from tests.support.configs import tuned_file


def test_a_bad_flag_value_names_the_flag_not_the_file(tmp_path, capsys):
    assert main(["plan", "--from", str(tuned_file(tmp_path / "best.yaml")), "--device-memory-limit", "lots"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("sltune plan: error: --device-memory-limit: cannot read 'lots' as a byte size; write")
    assert "best.yaml" not in err and err.count("device_memory_limit") == 0


def test_plan_s_disk_flags_on_a_best_yaml_are_refused_naming_the_flag(tmp_path, capsys):
    """A best.yaml's plan predicts from its fitted models without disk: --disk-limit and --disk-versions would change
    nothing, so each is refused in one line naming it and the spec to give instead."""
    best = str(tuned_file(tmp_path / "best.yaml"))
    for flag, value in (("--disk-limit", "1TiB"), ("--disk-versions", "1")):
        assert main(["plan", best, flag, value]) == 2
        err = capsys.readouterr().err
        assert err == (f"sltune plan: error: {flag}: {best} is a best.yaml, whose plan predicts from its fitted models "
                       f"without disk; give the tuning spec (sltune plan SPEC.yaml {flag} ...)\n"), err


def test_plan_reads_a_spec_before_any_trial_and_refuses_one_nothing_of_which_fits(tmp_path, capsys):
    small = tmp_path / "small.yaml"
    small.write_text("name: s\nmodel: {preset: llama-tiny}\nworkload: {seq_len: 32}\n"
                     "hardware: {device_memory_limit: 2MiB, host_memory_limit: 8GiB}\n"
                     "search: {sub_batch_size: [1, 4, 16], num_sub_batches: [1, 4], num_live_blocks: [1, 4]}\n")
    assert main(["plan", str(small)]) == 0
    out = capsys.readouterr().out
    assert "of 12 configs predicted to fit" in out and "no trial ran" in out
    assert "over device" in out and "  fits" in out and "binding limit: device" in out
    big = tmp_path / "big.yaml"
    big.write_text("name: b\nmodel: {preset: llama-2-7b, dtype: bfloat16}\nworkload: {seq_len: 128}\n"
                   "hardware: {host_memory_limit: 17GiB}\n")
    assert main(["plan", str(big)]) == 1
    out = capsys.readouterr().out
    assert "0 of 75 configs predicted to fit" in out
    refusal = next(line for line in out.splitlines() if line.startswith("  refused: "))
    assert "hardware.host_memory_limit 17.0 GiB is below the 11" in refusal
    assert "the weights in bfloat16 12.6, a float32 master copy 25.1, float32 gradients 25.1, AdamW's two " \
           "moments in float32 50.2, device buffers" in refusal and "What would fit: " in refusal


def test_cli_refuses_a_bad_spec_before_any_trial(tmp_path):
    spec = tmp_path / "bad.yaml"
    spec.write_text("name: x\nmodel: {preset: llama-tiny}\nsearch: {max_trails: 3}\n")
    db = tmp_path / "jobs.db"
    out = sltune("tune", str(spec), "--db", f"sqlite:///{db}")
    assert out.returncode == 2
    assert "search.max_trails: unknown field" in out.stderr and "Traceback" not in out.stderr
    assert not db.exists()
