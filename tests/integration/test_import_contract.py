"""The import contract (.importlinter): the runtime below the tuner and the service, tuning/'s rooms one way, no
circles, the light modules free of torch. lint-imports reads the package as installed (api/ and dashboards/ go in
as sltune.api and sltune.dashboards), so it runs on such a copy of the tree."""

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _installed_copy(tmp: Path) -> Path:
    skip = shutil.ignore_patterns("__pycache__")
    shutil.copytree(ROOT / "sltune", tmp / "sltune", ignore=skip)
    shutil.copytree(ROOT / "api", tmp / "sltune" / "api", ignore=skip)
    shutil.copytree(ROOT / "dashboards", tmp / "sltune" / "dashboards", ignore=skip)
    return tmp


def _lint(tree: Path) -> subprocess.CompletedProcess:
    lint = Path(sys.executable).with_name("lint-imports")
    return subprocess.run([str(lint), str(ROOT / ".importlinter")], cwd=tree, capture_output=True, text=True,
                          env={"PYTHONPATH": str(tree), "PATH": "/usr/bin:/bin"}, timeout=120)


def test_the_import_contract_holds(tmp_path):
    out = _lint(_installed_copy(tmp_path))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert "5 kept, 0 broken" in out.stdout


def test_a_runtime_module_importing_the_tuner_breaks_it(tmp_path):
    """The check can fail: the engine reaching up into tuning/ breaks the runtime's contract, and a cost-model
    module importing the search breaks the rooms'."""
    tree = _installed_copy(tmp_path)
    with open(tree / "sltune" / "runtime" / "engine.py", "a") as f:
        f.write("\nfrom sltune.tuning.search import state  # noqa\n")
    with open(tree / "sltune" / "tuning" / "cost" / "prior.py", "a") as f:
        f.write("\n\ndef _up():\n    from sltune.tuning.search.state import SearchState  # noqa\n")
    out = _lint(tree)
    assert out.returncode != 0
    assert "sltune.runtime is not allowed to import sltune.tuning" in out.stdout, out.stdout[-3000:]
    assert "sltune.tuning.cost.prior -> sltune.tuning.search.state" in out.stdout, out.stdout[-3000:]
