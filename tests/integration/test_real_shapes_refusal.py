"""A spec or trial of real shapes that cannot fit this machine is refused in one line before anything is
built (`tune` measures this machine's trial baseline with a trial first)."""

from sltune.cli.main import main


def test_a_spec_no_config_of_which_fits_this_machine_is_refused_before_any_trial(tmp_path, capsys):
    spec = tmp_path / "big.yaml"
    spec.write_text("name: big\nmodel: {preset: llama-2-7b, dtype: bfloat16}\nworkload: {seq_len: 64}\n")
    assert main(["tune", str(spec), "--db", f"sqlite:///{tmp_path / 'jobs.db'}"]) == 2
    err = next(line for line in capsys.readouterr().err.splitlines() if line.startswith("sltune tune: error:"))
    assert "hardware.host_memory_limit is not set, so this machine's trial ceiling" in err
    # the prior of the smallest config, term by term (GiB): the parameters' own terms, the device's buffers (on the
    # CPU, host memory too) and the process; more ranks would not help, as the limit holds them all together
    assert "the weights in bfloat16 12.6, a float32 master copy 25.1, float32 gradients 25.1, AdamW's two moments " \
           "in float32 50.2, device buffers" in err and "the process" in err and "world_size" not in err
    assert main(["profile", "--model", "llama-2-7b", "--dtype", "bfloat16", "--host-memory-limit", "17GiB",
                 "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert "this trial cannot fit: --host-memory-limit 17.0 GiB is below the 116." in err
    # the weights and the optimizer on disk would fit (sltune.tuning.cost.feasible names them first), named as the
    # flags this command takes, not as a spec's fields
    assert "What would fit: --param-offload disk with --optimizer-offload disk (" in err
    assert "search." not in err
