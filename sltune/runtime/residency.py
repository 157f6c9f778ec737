"""Which units stay on the device under `weights_on_device`: the engine decides it for its units and the tuner's
model shape and prior for their sizes, with the same two functions, so the prior predicts what the engine keeps.
No torch here: the service imports it (through the cost model) without paying for torch."""

from __future__ import annotations

from typing import Sequence, TypeVar

T = TypeVar("T")


def keep_order(tied: T, embed: T, head: T, groups: Sequence[T]) -> list[T]:
    """The order weights_on_device takes units in: tied weights, embedding, head, then the groups. The engine
    (its units) and the tuner's model shape (their sizes) both list them so, for kept_share."""
    return [tied, embed, head, *groups]


def kept_share(sizes: Sequence[int], share: float) -> list[bool]:
    """Which units a share of the weights keeps on the device: first fit, in keep_order, of every unit that
    still fits share*sum(sizes). Whole units, so the kept bytes never exceed the share: the device memory a
    share promises is an upper bound. The engine (on its units) and the tuner's fits (on a model's shape)
    both call this, so they agree on what a share keeps."""
    budget = share * sum(sizes)
    used, kept = 0, []
    for size in sizes:
        take = size > 0 and used + size <= budget * (1 + 1e-12)
        used += size if take else 0
        kept.append(take)
    return kept
