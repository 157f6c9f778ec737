"""A model's shape without its weights: layer count, sizes of the runtime's units, bytes per value.

Built on the meta device, so the shapes of a 70B model cost nothing. The tuner needs them for its
features (G = number of groups, W = the share of the weights generation keeps on the device) and for the
lower bounds a limit must clear.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch

from sltune.runtime.params import keep_order, kept_share


@dataclass(frozen=True)
class ModelShape:
    family: str
    layers: int
    hidden: int
    vocab: int
    itemsize: int
    layer_bytes: int        # the largest decoder layer's parameters
    embed_bytes: int        # the embedding unit (without tied weights)
    head_bytes: int         # final norm + head (without tied weights)
    tied_bytes: int
    param_bytes: int        # every parameter once
    max_positions: int | None = None

    def groups(self, k: int) -> int:
        return math.ceil(self.layers / k)

    def unit_bytes(self, k: int) -> list[int]:
        """The bytes of the units weights_on_device picks from, in the engine's order: tied weights,
        embedding, head, then the groups of k layers (the last one smaller when k does not divide them)."""
        full, rest = divmod(self.layers, k)
        groups = [k * self.layer_bytes] * full + ([rest * self.layer_bytes] if rest else [])
        return keep_order(self.tied_bytes, self.embed_bytes, self.head_bytes, groups)

    def kept_bytes(self, k: int, share: float) -> int:
        """The parameter bytes a share keeps on the device, in whole units as the engine keeps them."""
        return self._kept(k, share)[0]

    def min_device_bytes(self, mode: str, k: int = 1, share: float = 0.0) -> int:
        """What a config needs on the device at least: its largest unit live (with its gradients when
        training) - the smallest config, k=1, still holds one unit; in generation also the weights the
        share keeps there, beside the largest unit still streamed in."""
        unit = max(self.layer_bytes, self.embed_bytes + self.tied_bytes, self.head_bytes + self.tied_bytes)
        if mode == "train":
            return 2 * unit
        kept, streamed = self._kept(k, share)
        return max(unit, kept + streamed)

    def _kept(self, k: int, share: float) -> tuple[int, int]:
        """The bytes a share keeps, and the largest unit it leaves to be streamed in (0: none)."""
        sizes = self.unit_bytes(k)
        kept = kept_share(sizes, share)
        return (sum(size for size, keep in zip(sizes, kept) if keep),
                max((size for size, keep in zip(sizes, kept) if not keep), default=0))

    def min_host_bytes(self, mode: str) -> int:
        """Parameters in host memory; training adds gradients and AdamW's two moments."""
        return self.param_bytes * (4 if mode == "train" else 1)


def shape_of(model: Any, dtype: str = "float32") -> ModelShape:
    """Cached by the model's description: every spec validation asks, and big models take a second."""
    if isinstance(model, (str, dict)):
        return _cached(json.dumps(model, sort_keys=True, default=str), dtype)
    return _build(model, dtype)


@lru_cache(maxsize=64)
def _cached(key: str, dtype: str) -> ModelShape:
    return _build(json.loads(key), dtype)


def _build(model: Any, dtype: str) -> ModelShape:
    from transformers import AutoModelForCausalLM

    from sltune.models import load_config
    from sltune.runtime.family import CausalLM

    config = load_config(model)
    itemsize = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(config)
    meta.eval()
    prologue, layers, head = CausalLM(meta).param_groups()
    tied = {id(p) for p in prologue} & {id(p) for p in head}

    def nbytes(ps) -> int:
        return sum(p.numel() for p in ps) * itemsize

    every = {id(p): p for p in meta.parameters()}
    return ModelShape(
        family=config.model_type, layers=len(layers), hidden=config.hidden_size, vocab=config.vocab_size,
        itemsize=itemsize, layer_bytes=max(nbytes(ps) for ps in layers),
        embed_bytes=nbytes(p for p in prologue if id(p) not in tied),
        head_bytes=nbytes(p for p in head if id(p) not in tied),
        tied_bytes=nbytes(p for p in prologue if id(p) in tied),
        param_bytes=nbytes(every.values()),
        max_positions=getattr(config, "max_position_embeddings", None),
    )
