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
