"""Reading a user's YAML file: a syntax error is the user's to fix, so it becomes one line naming the
file, the line and the column, not a parser traceback. So does anything else that makes a file no spec: more
than MAX_YAML_BYTES (a spec or best.yaml is a few KB; a 50 MB file took minutes and gigabytes to parse),
bytes that are not UTF-8, nesting beyond what a spec needs (thousands of levels exhausted the parser's
recursion), and strings that are not Unicode text (a lone surrogate: see sltune.plaindata)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from sltune.plaindata import problems
from sltune.sizes import format_bytes

MAX_YAML_BYTES = 1 << 20


def read_yaml(path: str | Path) -> Any:
    size = Path(path).stat().st_size         # a missing file: the OSError names it
    if size > MAX_YAML_BYTES:
        raise ValueError(f"{path}: {format_bytes(size)} is more than a spec or config holds (at most "
                         f"{format_bytes(MAX_YAML_BYTES)}); check it is the file you meant")
    raw = Path(path).read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        line = raw.count(b"\n", 0, err.start) + 1
        raise ValueError(f"{path} line {line}: not UTF-8 text (byte 0x{raw[err.start]:02x}); save the file as "
                         "UTF-8") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ValueError(f"{path}{where}: not valid YAML ({problem}); fix the syntax there") from None
    except RecursionError:
        raise ValueError(f"{path}: nested too deep to read (thousands of levels); a spec needs a few: flatten "
                         "it") from None
    found = problems(data, finite=False)
    if found:
        raise ValueError(f"{path}: " + "; ".join(f"{where}: {msg}" if where else msg for where, msg in found[:5]))
    return data
