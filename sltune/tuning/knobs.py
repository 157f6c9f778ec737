"""The values one knob of a search takes: a number, a list, or a range of powers of two. Both the spec
(which validates them) and the search space (which enumerates them) read them from here."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

MAX_KNOB_VALUES = 64


class Range(BaseModel):
    """Powers of two from min to max, plus min and max themselves: {min: 1, max: 12} -> 1, 2, 4, 8, 12."""

    model_config = ConfigDict(extra="forbid")

    min: int = Field(ge=1)
    max: int = Field(ge=1)

    @model_validator(mode="after")
    def _ordered(self) -> "Range":
        if self.min > self.max:
            raise ValueError(f"min {self.min} > max {self.max}; swap them")
        return self

    def values(self) -> list[int]:
        out = {self.min, self.max}
        p = 1
        while p <= self.max:
            if p >= self.min:
                out.add(p)
            p *= 2
        return sorted(out)


def knob_values(knob: int | Range | list[int], field: str) -> list[int]:
    if isinstance(knob, Range):
        return knob.values()
    values = [knob] if isinstance(knob, int) else list(knob)
    if not values or any(v < 1 for v in values):
        raise ValueError(f"search.{field}: values must be positive integers, got {values}")
    return sorted(set(values))
