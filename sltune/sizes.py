"""Byte sizes as people write them ("2GiB", "512 MB", 1073741824) and back."""

from __future__ import annotations

import math
import re
from typing import Annotated, Any

from pydantic import BeforeValidator, ValidationInfo, WithJsonSchema

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3, "t": 1000**4, "tb": 1000**4,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
}
_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")
# what parse_bytes takes, as JSON schema (for the API's OpenAPI document and the reference pages)
SIZE_VALUE_SCHEMA = {"anyOf": [{"type": "number", "minimum": 1},
                               {"type": "string",
                                "pattern": r"^\s*[0-9]*\.?[0-9]+\s*([bB]|[kKmMgGtT]([bB]|[iI][bB])?)?\s*$"}]}


def parse_bytes(value: int | float | str, field: str = "size") -> int:
    """Bytes from an int or a string such as "2GiB" (binary) or "2GB" (decimal)."""
    if isinstance(value, bool):
        raise ValueError(f"{field}: expected a byte size such as 2147483648 or '2GiB', got {value!r}")
    if isinstance(value, (int, float)):
        if not math.isfinite(value) or value < 1:
            raise ValueError(f"{field}: must be a whole number of bytes >= 1 (or e.g. '2GiB'), got {value!r}")
        return int(value)
    match = _PATTERN.match(str(value))
    unit = match.group(2).lower() if match else None
    if not match or unit not in _UNITS:
        raise ValueError(
            f"{field}: cannot read {value!r} as a byte size; write a number of bytes or a number with a unit "
            "such as '512MiB', '2GiB' or '8GB'"
        )
    size = int(float(match.group(1)) * _UNITS[unit])
    if size < 1:
        raise ValueError(f"{field}: must be at least 1 byte, got {value!r}")
    return size


def _bytes_field(value: Any, info: ValidationInfo) -> int:
    return parse_bytes(value, info.field_name or "size")


# A model's byte-size field: bytes, or text such as "2GiB" read by parse_bytes (the CLI passes a flag's text as is)
Bytes = Annotated[int, BeforeValidator(_bytes_field), WithJsonSchema(SIZE_VALUE_SCHEMA)]


def format_bytes(n: int | float | None) -> str:
    """A short human form with binary units: 1536 -> '1.5 KiB'."""
    if n is None:
        return "-"
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
