"""Weights for measuring, not for learning: what a trial of a preset or a config runs on.

A trial needs the model's shapes and realistic magnitudes, not Kaiming: building a 7B model with
transformers' own init took 74 s of a trial's time. Here the model is built with its parameters on the meta
device and the engine's host buffers are filled in place, each unit once: norms with ones, biases with zeros,
every other weight with copies of one seeded block of normal values (std: the config's initializer_range), a
memcpy's cost. Seeded, so a trial is repeatable; periodic, which no throughput or memory figure can tell.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch
from torch import nn

from sltune.models.checkpoint import parameters_on_meta

BLOCK = 1 << 20      # values in the random block: 4 MiB, generated once per trial, then copied doubling


class SeededWeights:
    """A model's config and a seed: the `weights` the engine fills its buffers from."""

    def __init__(self, config: Any, seed: int = 0):
        self.config = config
        self.seed = seed
        self.std = float(getattr(config, "initializer_range", None) or 0.02)

    def empty_model(self) -> nn.Module:
        from transformers import AutoModelForCausalLM

        with parameters_on_meta():
            return AutoModelForCausalLM.from_config(self.config)

    @contextlib.contextmanager
    def reader(self, model: nn.Module) -> Iterator[Callable[[nn.Parameter, torch.Tensor], None]]:
        ones = {id(p) for m in model.modules() if "norm" in type(m).__name__.lower()
                for name, p in m.named_parameters(recurse=False) if name == "weight"}
        zeros = {id(p) for name, p in model.named_parameters(remove_duplicate=False)
                 if name.rsplit(".", 1)[-1] == "bias"}
        gen = torch.Generator().manual_seed(self.seed)
        block = torch.randn(BLOCK, generator=gen) * self.std
        cast: dict[torch.dtype, torch.Tensor] = {}

        def fill(p: nn.Parameter, dst: torch.Tensor) -> None:
            if id(p) in ones:
                dst.fill_(1.0)
            elif id(p) in zeros:
                dst.zero_()
            else:
                if dst.dtype not in cast:
                    cast[dst.dtype] = block.to(dst.dtype)
                src = cast[dst.dtype]
                flat = dst.view(-1)
                done = min(BLOCK, flat.numel())
                flat[:done].copy_(src[:done])
                while done < flat.numel():        # doubling copies: large enough for every thread to share
                    more = min(done, flat.numel() - done)
                    flat[done:done + more].copy_(flat[:more])
                    done += more

        yield fill
