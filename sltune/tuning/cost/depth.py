"""A model's depth as the cost model sees it: the least depth a probe may run at, and the parameter and
compute bytes of the step time at any layer count (how sltune.tuning.search.probes scales reduced-depth probes
to the whole model)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable

if TYPE_CHECKING:
    from sltune.tuning.cost.shape import ModelShape


def least_probe_layers(k_values: Iterable[int]) -> int:
    """The fewest layers a probe may run: two groups of the largest k."""
    return 2 * max(k_values)


@dataclass(frozen=True)
class DepthTerms:
    """The shape's depth-dependent quantities of the step time, P and F, at any layer count (uniform layers: the
    largest one's bytes, as ModelShape counts them)."""

    layers: int                  # the model's own
    layer_bytes: int
    other_bytes: int             # embedding, head, tied weights: P = other + L*layer
    head_bytes: int              # what a token's compute reads beyond the layers: the head (or the tied weight)

    @classmethod
    def of(cls, shape: "ModelShape") -> "DepthTerms":
        return cls(layers=shape.layers, layer_bytes=shape.layer_bytes,
                   other_bytes=shape.param_bytes - shape.layers * shape.layer_bytes,
                   head_bytes=shape.head_bytes + shape.tied_bytes)

    def vars(self, layers: int) -> dict[str, float]:
        return {"P": float(self.other_bytes + layers * self.layer_bytes),
                "F": float(self.head_bytes + layers * self.layer_bytes)}
