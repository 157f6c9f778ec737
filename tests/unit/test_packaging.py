"""Every package folder is installed, under the names users import."""

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_pyproject_lists_every_package():
    conf = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(conf["packages"])
    mapped = {name: ROOT / path for name, path in conf["package-dir"].items()}
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "sltune").rglob("__init__.py")}
    for name, path in mapped.items():
        found |= {name + "".join("." + part for part in p.parent.relative_to(path).parts)
                  for p in path.rglob("__init__.py")}
    assert found == listed


def test_api_and_dashboards_import_under_sltune():
    import sltune.api
    import sltune.dashboards

    assert Path(sltune.api.__file__).parent == ROOT / "api"
    assert Path(sltune.dashboards.__file__).parent == ROOT / "dashboards"
