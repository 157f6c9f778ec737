"""A package's public names, loaded on first use (PEP 562).

`sltune submit`, `export`, the API process and the spec's validation import sltune's light modules; the
names that need torch (the engine, trials, model builds) load it only when touched, which saves each such
process a second or more of import.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable


def exports(package: str, where: dict[str, str]) -> Callable[[str], Any]:
    """A module `__getattr__` that imports `where[name]` and returns its `name`."""

    def __getattr__(name: str) -> Any:
        if name not in where:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(where[name]), name)

    return __getattr__
