"""The import contract (.importlinter): the runtime below the tuner and the service, tuning/'s rooms one way, no
circles, the light modules free of torch. lint-imports runs on a copy of the package (a test breaks it on purpose)."""

import ast
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _copy(tmp: Path) -> Path:
    skip = shutil.ignore_patterns("__pycache__")
    shutil.copytree(ROOT / "sltune", tmp / "sltune", ignore=skip)
    return tmp


def _lint(tree: Path, config: str = ".importlinter") -> subprocess.CompletedProcess:
    lint = Path(sys.executable).with_name("lint-imports")
    return subprocess.run([str(lint), str(ROOT / config)], cwd=tree, capture_output=True, text=True,
                          env={"PYTHONPATH": str(tree), "PATH": "/usr/bin:/bin"}, timeout=120)


def test_the_import_contract_holds(tmp_path):
    tree = _copy(tmp_path)
    out = _lint(tree)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert "6 kept, 0 broken" in out.stdout
    out = _lint(tree, ".importlinter-light")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert "1 kept, 0 broken" in out.stdout


def test_an_import_for_type_hints_alone_counts_in_the_design(tmp_path):
    """A circle through a TYPE_CHECKING import is a circle of the design (the three there were: engine and traffic,
    the prior and the wrapped prior, the probes and the search state): the contract counts it."""
    tree = _copy(tmp_path)
    with open(tree / "sltune" / "runtime" / "traffic.py", "a") as f:
        f.write("\nif TYPE_CHECKING:\n    from sltune.runtime.engine import SpeedLoaderEngine  # noqa\n")
    out = _lint(tree)
    assert out.returncode != 0
    assert "No cycles are allowed in sltune.runtime" in out.stdout and ".traffic -> .engine" in out.stdout, \
        out.stdout[-3000:]


def test_a_runtime_module_importing_the_tuner_breaks_it(tmp_path):
    """The check can fail: the engine reaching up into tuning/ breaks the runtime's contract, and a cost-model
    module importing the search breaks the rooms'."""
    tree = _copy(tmp_path)
    with open(tree / "sltune" / "runtime" / "engine.py", "a") as f:
        f.write("\nfrom sltune.tuning.search import state  # noqa\n")
    with open(tree / "sltune" / "tuning" / "cost" / "prior.py", "a") as f:
        f.write("\n\ndef _up():\n    from sltune.tuning.search.state import SearchState  # noqa\n")
    out = _lint(tree)
    assert out.returncode != 0
    assert "sltune.runtime is not allowed to import sltune.tuning" in out.stdout, out.stdout[-3000:]
    assert "sltune.tuning.cost.prior -> sltune.tuning.search.state" in out.stdout, out.stdout[-3000:]


# -- private names stay in their module -----------------------------------------------------------------------
PROJECT = ("sltune", "tests", "bench")


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_reach_ins(source: str) -> list[str]:
    """`from sltune.x import _y`, and `m._y` where `m` was imported from this project (a module or a class): a
    name starting with `_` used outside the module that defines it."""
    tree = ast.parse(source)
    imported, found = set(), []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in PROJECT:
            found += [f"line {node.lineno}: from {node.module} import {a.name}" for a in node.names if _private(a.name)]
            imported |= {a.asname or a.name for a in node.names}
        elif isinstance(node, ast.Import):
            imported |= {a.asname or a.name.split(".")[0] for a in node.names if a.name.split(".")[0] in PROJECT}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr) and isinstance(node.value, ast.Name) \
                and node.value.id in imported:
            found.append(f"line {node.lineno}: {node.value.id}.{node.attr}")
    return sorted(found)


def private_members(source: str) -> set[str]:
    """The private attributes and methods a module's classes give their objects (`self._x = ...`, `def _x`)."""
    out = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and isinstance(node.value, ast.Name) \
                and node.value.id in ("self", "cls") and _private(node.attr):
            out.add(node.attr)
        elif isinstance(node, ast.ClassDef):
            out |= {f.name for f in node.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                    and _private(f.name)}
    return out


def member_reach_ins(source: str, members: set[str]) -> list[str]:
    """`obj._x` on an object of the project's (an engine, its stepper, a folder of files), `x` one of `members`:
    what a test or a benchmark reads or replaces in there instead of a public name. An object's own (self, cls)
    are not reach-ins."""
    return sorted(f"line {node.lineno}: {ast.unparse(node)}" for node in ast.walk(ast.parse(source))
                  if isinstance(node, ast.Attribute) and node.attr in members
                  and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")))


def test_no_module_reaches_into_another_s_private_names():
    """The reach-ins there were (engine._detached, checkpoints._record, cli.main._one_line, ...) are public names now,
    and none comes back: every .py of the package (its API and pages too), bench/ and tests/."""
    files = [p for folder in ("sltune", "bench", "tests") for p in (ROOT / folder).rglob("*.py")]
    assert len(files) > 200
    found = [f"{p.relative_to(ROOT)} {hit}" for p in files for hit in private_reach_ins(p.read_text())]
    assert not found, "\n".join(found)


def test_no_test_or_benchmark_reaches_into_the_project_s_objects():
    """Fault injection and counters read through public names (an engine's stepper, a folder's committed files, a
    backward hook on the model's own module), not an object's private attributes."""
    members = set().union(*(private_members(p.read_text()) for p in (ROOT / "sltune").rglob("*.py")))
    assert {"_stepper", "_current", "_dropped"} & members == {"_current", "_dropped"}    # still private there
    files = [p for folder in ("bench", "tests") for p in (ROOT / folder).rglob("*.py")]
    found = [f"{p.relative_to(ROOT)} {hit}" for p in files for hit in member_reach_ins(p.read_text(), members)]
    assert not found, "\n".join(found)
    assert member_reach_ins("engine.disk._dropped; self._dropped; x.stepper.done", members) \
        == ["line 1: engine.disk._dropped"]


def test_the_reach_in_check_finds_both_kinds():
    assert private_reach_ins("from sltune.runtime.engine import _detached, SpeedLoaderEngine\n"
                             "from sltune.training import checkpoints\n"
                             "import sltune.cli.main\n"
                             "checkpoints._record(1); SpeedLoaderEngine._plan; self._x; obj._y; "
                             "checkpoints.__doc__\n") \
        == ["line 1: from sltune.runtime.engine import _detached", "line 4: SpeedLoaderEngine._plan",
            "line 4: checkpoints._record"]


# -- rooms a reader can take in -----------------------------------------------------------------------------------
MAX_FILE_LINES = 750
MAX_FUNCTION_LINES = 100


def test_no_module_over_750_lines_and_no_function_over_100():
    """A file is read top to bottom and a function at a glance: past these, split it by job (the migrations, which
    are generated and never read as code, aside)."""
    long_files, long_functions = [], []
    for path in sorted((ROOT / "sltune").rglob("*.py")):
        if "migrations" in path.parts:
            continue
        text = path.read_text()
        name = path.relative_to(ROOT)
        if text.count("\n") > MAX_FILE_LINES:
            long_files.append(f"{name}: {text.count(chr(10))} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) \
                    and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES:
                long_functions.append(f"{name}:{node.lineno} {node.name}: {node.end_lineno - node.lineno + 1} lines")
    assert not long_files and not long_functions, long_files + long_functions
