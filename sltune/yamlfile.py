"""Reading a user's YAML file: a syntax error is the user's to fix, so it becomes one line naming the
file, the line and the column, not a parser traceback."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml


def read_yaml(path: str | Path) -> Any:
    text = Path(path).read_text()
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ValueError(f"{path}{where}: not valid YAML ({problem}); fix the syntax there") from None
