"""The RNG states a recomputed forward replays, so that dropout draws the same numbers in the group's backward as in
its forward (the recompute of `activations: recompute`)."""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch


class RngStash:
    """Dropout must draw the same numbers when a group is recomputed: keep the RNG state per
    (unit, sub-batch) at the forward and replay it in backward, as torch.utils.checkpoint does."""

    def __init__(self, device: torch.device, enabled: bool):
        self.enabled = enabled
        self.cuda = device.type == "cuda"
        self.device = device
        self._states: dict = {}

    @contextlib.contextmanager
    def save(self, key) -> Iterator[None]:
        if self.enabled:
            self._states[key] = (torch.get_rng_state(),
                                 torch.cuda.get_rng_state(self.device) if self.cuda else None)
        yield

    @contextlib.contextmanager
    def replay(self, key) -> Iterator[None]:
        if not self.enabled:
            yield
            return
        cpu, cuda = self._states.pop(key)
        with torch.random.fork_rng(devices=[self.device] if self.cuda else []):
            torch.set_rng_state(cpu)
            if cuda is not None:
                torch.cuda.set_rng_state(cuda, self.device)
            yield
