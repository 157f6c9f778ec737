"""Every package folder is installed, under the names users import, with its package data."""

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


def test_every_template_ships_as_package_data():
    """pip install . (not editable) carries sltune/dashboards/templates/ only where pyproject's package data
    names it."""
    import fnmatch
    import tomllib

    root = Path(__file__).resolve().parents[2]
    conf = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    pages = root / "sltune" / "dashboards"
    names = [p.relative_to(pages).as_posix() for p in (pages / "templates").rglob("*")
             if p.is_file()]
    assert "templates/base.html" in names
    assert all(any(fnmatch.fnmatch(n, g) for g in conf["sltune.dashboards"]) for n in names), names
