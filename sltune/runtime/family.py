"""How sltune calls a transformers causal LM by its parts, without editing its code.

A decoder-only LM is: a prologue (embeddings, positions, masks), a list of decoder layers, a final norm
and the LM head. The prologue is whatever the library's own base-model forward does before its first
layer, so sltune runs exactly that forward with each layer's forward replaced by a recorder: the
recorders see the hidden state and the exact arguments the library passes to every layer (causal or
sliding-window masks, rotary embeddings, position ids, caches), and the last one stops the forward.
Only the epilogue differs by family and is named in a small table.
"""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from torch import nn

from sltune.models.presets import SUPPORTED_FAMILIES


@dataclass(frozen=True)
class Family:
    layers: str              # attribute of the base model holding the decoder layers
    final: tuple[str, ...]   # attributes of the base model applied after the last layer, in order


FAMILIES: dict[str, Family] = {
    "llama": Family("layers", ("norm",)),
    "mistral": Family("layers", ("norm",)),
    "qwen2": Family("layers", ("norm",)),
    "gpt2": Family("h", ("ln_f",)),
    "opt": Family("layers", ("final_layer_norm", "project_out")),
}
assert set(FAMILIES) == set(SUPPORTED_FAMILIES)


class _Stop(Exception):
    """Raised by the last recorder: the prologue is done."""


@dataclass
class LayerCall:
    """The arguments the library passes to one decoder layer (hidden state at args[0] is replaced)."""

    args: tuple
    kwargs: dict[str, Any]


class CausalLM:
    """A supported transformers causal LM seen as prologue, layers, epilogue and loss."""

    def __init__(self, model: nn.Module):
        config = getattr(model, "config", None)
        family = getattr(config, "model_type", None)
        if family not in FAMILIES:
            raise ValueError(
                f"model family {family!r} ({type(model).__name__}) is not supported; supported families: "
                f"{', '.join(SUPPORTED_FAMILIES)}"
            )
        if model.get_output_embeddings() is None:
            raise ValueError(f"{type(model).__name__} has no LM head; pass a *ForCausalLM model")
        self.model = model
        self.config = config
        self.family = FAMILIES[family]
        self.base = model.get_decoder()
        self.layers: nn.ModuleList = getattr(self.base, self.family.layers)
        self.final = [m for m in (getattr(self.base, a, None) for a in self.family.final) if m is not None]
        self.lm_head = model.get_output_embeddings()
        self.cache_arg = cache_argument(self.base)
        if getattr(config, "layerdrop", 0.0) and model.training:
            raise ValueError("layerdrop > 0 skips layers at random; set config.layerdrop = 0 to train with sltune")

    # -- which parameters belong where -------------------------------------------------------------
    def param_groups(self) -> tuple[list[nn.Parameter], list[list[nn.Parameter]], list[nn.Parameter]]:
        """(prologue params, each layer's params, final norm + head params); a tied weight is in the first
        and the last list."""
        layer_params = [unique_params(layer.parameters()) for layer in self.layers]
        in_layers = {id(p) for ps in layer_params for p in ps}
        in_final = {id(p) for m in self.final for p in m.parameters()}
        head = unique_params(p for m in [*self.final, self.lm_head] for p in m.parameters())
        # a weight tied between embedding and head is in both lists; the engine gives it its own unit
        prologue = [p for p in unique_params(self.base.parameters()) if id(p) not in in_layers | in_final]
        in_final |= {id(p) for p in head}
        covered = in_layers | in_final | {id(p) for p in prologue}
        stray = [n for n, p in self.model.named_parameters(remove_duplicate=False) if id(p) not in covered]
        if stray:
            raise ValueError(f"parameters outside the embedding, layers and head are not supported: {stray[:5]}")
        seen: dict[int, int] = {}
        for j, ps in enumerate(layer_params):
            for p in ps:
                if id(p) in seen:
                    raise ValueError(f"layers {seen[id(p)]} and {j} share a parameter; sltune needs layers "
                                     "with their own weights")
                seen[id(p)] = j
        return prologue, layer_params, head

    # -- the forward, by parts ----------------------------------------------------------------------
    def prologue(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                 cache: Any = None, **forward_kwargs: Any) -> tuple[torch.Tensor, list[LayerCall]]:
        """Run the library's forward up to the first layer: the hidden state and every layer's arguments.
        A KV `cache` (a transformers Cache) is passed under the name this transformers takes it by."""
        if cache is not None:
            forward_kwargs[self.cache_arg] = cache
        calls: list[LayerCall] = []
        with self._recorders(calls):
            try:
                self.base(input_ids=input_ids, attention_mask=attention_mask, **forward_kwargs)
            except _Stop:
                pass
        if len(calls) != len(self.layers):
            raise RuntimeError(f"{type(self.base).__name__} called {len(calls)} of {len(self.layers)} layers; "
                               "this model's forward is not supported")
        return calls[0].args[0], calls

    @contextlib.contextmanager
    def _recorders(self, calls: list[LayerCall]) -> Iterator[None]:
        last = len(self.layers) - 1

        def recorder(j: int):
            def forward(*args, **kwargs):
                if not args or not torch.is_tensor(args[0]):
                    raise RuntimeError("decoder layer called without the hidden state as first argument")
                calls.append(LayerCall(args, kwargs))
                if j == last:
                    raise _Stop
                return args[0]
            return forward

        for j, layer in enumerate(self.layers):
            layer.forward = recorder(j)
        try:
            yield
        finally:
            for layer in self.layers:
                del layer.forward

    def run_layers(self, first: int, last: int, hidden: torch.Tensor, calls: list[LayerCall]) -> torch.Tensor:
        """Layers first..last-1 on one sub-batch, called as the library calls them."""
        for j in range(first, last):
            call = calls[j]
            out = self.layers[j](hidden, *call.args[1:], **call.kwargs)
            hidden = out[0] if isinstance(out, tuple) else out
        return hidden

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        for module in self.final:
            hidden = module(hidden)
        return self.lm_head(hidden)

    def loss(self, logits: torch.Tensor, labels: torch.Tensor, num_items: int) -> torch.Tensor:
        """The model's own loss, as a sum over this sub-batch divided by the whole batch's token count."""
        return self.model.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size,
                                        num_items_in_batch=num_items)


def cache_argument(base: nn.Module) -> str:
    """The name under which this library's base model takes a KV cache: `cache` where transformers has renamed
    it (5.x, which warns that `past_key_values` is deprecated on every call), else `past_key_values` (4.x).
    Asked of the forward's own signature: both take **kwargs, where a name they do not know is silently lost."""
    return "cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values"


def unique_params(params) -> list[nn.Parameter]:
    """Each parameter once, in order."""
    seen: dict[int, nn.Parameter] = {}
    for p in params:
        seen.setdefault(id(p), p)
    return list(seen.values())
