"""What a spec read from JSON or YAML may hold before any model sees it: plain data that every later step (the
store, the API's answers, a YAML export) can write back out.

Refused, naming the field: strings (keys too) that are not Unicode text (a lone UTF-16 surrogate such as
"\\udfff", which JSON's \\u escapes and YAML's allow but UTF-8 cannot encode, so the job could never be read
back), numbers out of a double's range (1e400 parses as infinity and would be stored as null), and nesting
deeper than any spec needs (a parser's recursion is the only other bound). The walk is iterative, so a deep
document cannot exhaust the stack here either.
"""

from __future__ import annotations

import math
from typing import Any

MAX_DEPTH = 32          # a spec's deepest real nesting is model.hf_config.text_config.rope_scaling.<key>: 5


def problems(data: Any, max_depth: int = MAX_DEPTH, finite: bool = True) -> list[tuple[str, str]]:
    """(field path, message naming the fix) for each place `data` holds what it may not; [] when it is plain.
    finite=False lets infinities and NaN through (YAML writes them as .inf and .nan, and an exported
    best.yaml may hold one)."""
    out: list[tuple[str, str]] = []
    stack: list[tuple[Any, tuple[str, ...]]] = [(data, ())]
    deep_reported = False
    while stack:
        value, path = stack.pop()
        where = ".".join(path)
        if len(path) > max_depth:
            if not deep_reported:
                out.append((".".join(path[:max_depth]), f"nested more than {max_depth} levels deep; a spec needs "
                                                        "a few: flatten it"))
                deep_reported = True
            continue
        if isinstance(value, str):
            if not _is_text(value):
                out.append((where, "holds a lone UTF-16 surrogate (such as \\udfff), which is not Unicode text; "
                                   "remove it or write the character it was meant to be"))
        elif isinstance(value, float):
            if finite and not math.isfinite(value):
                out.append((where, "is out of range for a number (beyond about ±1.8e308, or NaN); give a finite "
                                   "number"))
        elif isinstance(value, dict):
            for key, item in value.items():
                name = str(key)
                if not _is_text(name):
                    out.append((where, "has a key holding a lone UTF-16 surrogate (such as \\udfff), which is not "
                                       "Unicode text; rename it"))
                    name = readable(name)
                stack.append((item, (*path, name)))
        elif isinstance(value, (list, tuple)):
            stack.extend((item, (*path, str(i))) for i, item in enumerate(value))
    return sorted(set(out))


def _is_text(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def readable(value: Any) -> Any:
    """`value` with every string's lone surrogates replaced by U+FFFD: what a job stored before they were
    refused (or by another writer) reads back as, so it can always be answered."""
    if isinstance(value, str):
        return value if _is_text(value) else "".join("\ufffd" if "\ud800" <= ch <= "\udfff" else ch for ch in value)
    if isinstance(value, dict):
        return {readable(k): readable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [readable(v) for v in value]
    return value
