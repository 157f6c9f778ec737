"""The one way a validation error reaches a user: each bad field's dotted path, then why, with the fix where
pydantic's own text has none, all on one line. A config, a spec, the optimizer section, flags, settings and the API
say their errors through it, so the same mistake reads the same everywhere (light: no torch)."""

from __future__ import annotations

from typing import Any, Callable, Iterable

from pydantic import ValidationError

# pydantic's names of a union's members inside a location ('search.sub_batch_size.int'): not fields a user wrote
UNION_MEMBERS = ("int", "list[", "Range", "function-")
UNKNOWN = "unknown field; check its spelling"
MISSING = "required field is missing"


def unknown_among(fields: Iterable[str]) -> str:
    """The fix for a field a model does not have, naming those it has."""
    return f"unknown field; check the spelling (fields: {', '.join(fields)})"


def field_error(error: dict[str, Any], *, within: str = "", unknown: str = UNKNOWN,
                name: Callable[[str], str] | None = None) -> tuple[str, str]:
    """(field, reason) of one pydantic error. `within`: the section the fields sit in ('optimizer'); `name`: how
    the user wrote a field (a flag, an environment variable); `unknown`: the fix for a field that is not one. The
    reason never echoes the input (it may not encode), nor the field its validator already named (by its path
    or its own name)."""
    where = ".".join(str(p) for p in error["loc"] if not str(p).startswith(UNION_MEMBERS))
    reason = error["msg"].removeprefix("Value error, ").removeprefix(f"{where}: ").removeprefix(
        f"{where.rpartition('.')[2]}: ")
    if where and reason.startswith(f"{where}."):     # a section's check that names the field it blames within it
        where = ""
    if error["type"] == "extra_forbidden":
        reason = unknown
    elif error["type"] == "missing":
        reason = MISSING
    if where and name is not None:
        where = name(where)
    if within:
        where = f"{within}.{where}" if where else within
    return where, reason


def field_errors(err: ValidationError | Iterable[dict[str, Any]], **how: Any) -> list[tuple[str, str]]:
    """(field, reason) per error, each once; `how` as field_error takes it."""
    errors = err.errors() if isinstance(err, ValidationError) else err
    return list(dict.fromkeys(field_error(e, **how) for e in errors))


def one_line(err: ValidationError | Iterable[dict[str, Any]], **how: Any) -> str:
    """'num_live_blocks: Input should be greater than or equal to 1; offload_dir: ...': a check across fields says
    its reason alone (it names the field it blames)."""
    return "; ".join(f"{where}: {reason}" if where else reason for where, reason in field_errors(err, **how))
