"""The commands that only talk to a server or a database (`submit`, `compare`, `export`'s client, `-h`), the
spec's models and the API's processes (until a dashboard page needs a model's shape; the spec checks run in
processes of their own) load without torch: each such process saves a second or more of import (the suite runs
hundreds)."""

import os
import subprocess
import sys

LIGHT = ["sltune", "sltune.cli.main", "sltune.profiling", "sltune.profiling.schema", "sltune.tuning",
         "sltune.tuning.report.compare", "sltune.service.client", "sltune.store", "sltune.models",
         "sltune.service.capabilities", "sltune.training.optimizer", "sltune.training.schedule",
         "sltune.backend_knobs", "sltune.backends", "sltune.backends.export", "sltune.api.app",
         "sltune.dashboards.pages", "sltune.tuning.report.result", "sltune.tuning.search.study"]


def test_light_modules_do_not_import_torch_and_the_public_names_still_resolve(tmp_path):
    code = ("import importlib, sys\n"
            f"for m in {LIGHT!r}: importlib.import_module(m)\n"
            "from sltune.api.app import create_app\n"
            "create_app()\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n"
            "from sltune import SpeedLoaderConfig, IOCounters\n"
            "assert 'torch' not in sys.modules, 'the config or the counters imported torch'\n"
            "from sltune import SpeedLoaderEngine\n"
            "from sltune.profiling import run_trial\n"
            "assert 'torch' in sys.modules and callable(run_trial) and SpeedLoaderEngine.__name__\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "SLTUNE_DATA_DIR": str(tmp_path)})     # create_app's store
    assert out.returncode == 0, out.stderr[-2000:]


def test_a_whole_tune_and_its_plan_run_in_a_process_that_never_imports_torch(tmp_path):
    """`sltune tune`'s and `sltune worker`'s own process held torch and transformers (5 s of import each on 2 cores)
    beside their fork server: the model's shape and traces, the devices and the trials now come from children of the
    fork server (sltune.profiling.forks.call), so neither library is imported here while a job runs, its prior and
    its plan are predicted, and best.yaml is written."""
    import yaml

    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump({
        "name": "light", "model": {"preset": "llama-tiny"}, "workload": {"seq_len": 16},
        "search": {"sub_batch_size": [1, 2], "num_sub_batches": [1], "num_live_blocks": [1], "max_trials": 2,
                   "trial_steps": 1, "trial_max_steps": 1, "trial_min_time_s": 0, "confirm_rounds": 0,
                   "profile": False}}))
    code = ("import sys\n"
            "from sltune.cli.main import main\n"
            f"assert main(['plan', {str(spec)!r}]) == 0\n"
            f"assert main(['tune', {str(spec)!r}, '--db', 'sqlite:///{tmp_path}/jobs.db', '--json', '--out', "
            f"{str(tmp_path / 'best.yaml')!r}]) == 0\n"
            "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, 'imported here'\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                         env={**os.environ, "SLTUNE_DATA_DIR": str(tmp_path)})
    assert out.returncode == 0, out.stderr[-2000:]
    assert '"status": "succeeded"' in out.stdout and (tmp_path / "best.yaml").is_file()
