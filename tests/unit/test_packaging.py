"""Every package folder is installed, under the names users import."""

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_pyproject_lists_every_package():
    conf = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(conf["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "sltune").rglob("__init__.py")}
    assert found == listed
    assert "package-dir" not in conf        # every package sits where its import path says


def test_api_and_dashboards_import_from_where_they_sit():
    import sltune.api
    import sltune.dashboards

    assert Path(sltune.api.__file__).parent == ROOT / "sltune" / "api"
    assert Path(sltune.dashboards.__file__).parent == ROOT / "sltune" / "dashboards"
