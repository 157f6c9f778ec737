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
from pathlib import Path
from typing import Any

from sltune.runtime.residency import keep_order, kept_share
from sltune.profiling import forks


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
    dtype: str = "float32"
    kv_heads: int = 0       # key/value heads and head dim: what a KV cache holds per position and layer
    head_dim: int = 0
    # each unit's parameters' sizes (values) in the engine's order: how optimizer_offload disk packs its files
    # (sltune.runtime.disk.state); empty: the unit as one tensor
    layer_numels: tuple[int, ...] = ()
    embed_numels: tuple[int, ...] = ()
    head_numels: tuple[int, ...] = ()
    tied_numels: tuple[int, ...] = ()

    def groups(self, k: int) -> int:
        return math.ceil(self.layers / k)

    def units(self, k: int) -> list[tuple[str, int]]:
        """The units weights_on_device picks from, named and with their bytes, in the engine's order: tied weights,
        embedding, head, then the groups of k layers ("group0", ...; the last one smaller when k does not divide
        them)."""
        full, rest = divmod(self.layers, k)
        groups = [k * self.layer_bytes] * full + ([rest * self.layer_bytes] if rest else [])
        return keep_order(("tied", self.tied_bytes), ("embed", self.embed_bytes), ("head", self.head_bytes),
                          [(f"group{i}", nbytes) for i, nbytes in enumerate(groups)])

    def unit_bytes(self, k: int) -> list[int]:
        """The bytes of the units weights_on_device picks from, in the engine's order (units)."""
        return [nbytes for _, nbytes in self.units(k)]

    def kept_units(self, k: int, share: float) -> set[str]:
        """The names of the units a share keeps on the device, as the engine picks them (units' names)."""
        units = self.units(k)
        return {name for (name, _), keep in zip(units, kept_share([n for _, n in units], share)) if keep}

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

    def host_terms(self, mode: str, mixed_precision: bool = True, optimizer: Any = None) -> list[tuple[str, int]]:
        """What any config holds in host memory, term by term: the weights in dtype; training adds, per
        parameter (all are trained), under a float32 master (mixed precision in bfloat16/float16) the master's
        4 bytes, 4 bytes of float32 gradients and the optimizer's state in float32, else gradients and state in
        dtype. `optimizer` is an OptimizerConfig (default AdamW: two moments)."""
        from sltune.training.optimizer import OptimizerConfig

        terms = [(f"the weights in {self.dtype}", self.param_bytes)]
        if mode != "train":
            return terms
        opt = optimizer if optimizer is not None else OptimizerConfig()
        count = self.param_bytes // self.itemsize
        master = mixed_precision and self.dtype != "float32"
        kind, size = ("float32", 4) if master else (self.dtype, self.itemsize)
        if master:
            terms.append(("a float32 master copy", 4 * count))
        terms.append((f"{kind} gradients", size * count))
        state = opt.state_bytes_per_param(size) * count
        if state:
            what = "AdamW's two moments" if opt.name == "adamw" else "SGD's momentum buffer"
            terms.append((f"{what} in {kind}", state))
        return terms

    def min_host_bytes(self, mode: str, mixed_precision: bool = True, optimizer: Any = None) -> int:
        """The weights in host memory; training adds the master, gradients and optimizer state (host_terms)."""
        return sum(n for _, n in self.host_terms(mode, mixed_precision, optimizer))


def shape_of(model: Any, dtype: str = "float32") -> ModelShape:
    """Cached by the model's description (a folder's by its config.json's modification time too): every spec
    validation asks, and big models take a second."""
    if isinstance(model, (str, dict)):
        return _cached(json.dumps(model, sort_keys=True, default=str), dtype, _modified(model))
    return _build(model, dtype)


def _modified(model: Any) -> int | None:
    if not isinstance(model, str):
        return None
    path = Path(model)
    try:
        return (path / "config.json" if path.is_dir() else path).stat().st_mtime_ns
    except (OSError, ValueError):
        return None      # a preset's name


@lru_cache(maxsize=64)
def _cached(key: str, dtype: str, modified: int | None) -> ModelShape:
    return forks.call(f"{__name__}:_build", json.loads(key), dtype)     # transformers' code: where it is imported


def _build(model: Any, dtype: str) -> ModelShape:
    import torch
    from transformers import AutoModelForCausalLM

    from sltune.models import load_config
    from sltune.runtime.family import CausalLM
    from sltune.runtime.generate import kv_dims

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
    largest = max(layers, key=nbytes)

    def numels(ps) -> tuple[int, ...]:
        return tuple(p.numel() for p in ps)

    return ModelShape(
        family=config.model_type, layers=len(layers), hidden=config.hidden_size, vocab=config.vocab_size,
        itemsize=itemsize, layer_bytes=max(nbytes(ps) for ps in layers),
        embed_bytes=nbytes(p for p in prologue if id(p) not in tied),
        head_bytes=nbytes(p for p in head if id(p) not in tied),
        tied_bytes=nbytes(p for p in prologue if id(p) in tied),
        param_bytes=nbytes(every.values()),
        max_positions=getattr(config, "max_position_embeddings", None), dtype=dtype,
        kv_heads=kv_dims(config)[0], head_dim=kv_dims(config)[1],
        layer_numels=numels(largest), embed_numels=numels(p for p in prologue if id(p) not in tied),
        head_numels=numels(p for p in head if id(p) not in tied),
        tied_numels=numels(p for p in prologue if id(p) in tied),
    )
