"""Token batches for training: a file of token ids, or a synthetic corpus when there is none."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import numpy as np
import torch


def load_tokens(path: str | Path) -> torch.Tensor:
    """A 1-D stream of token ids from .npy, .pt or a raw uint16 .bin (nanoGPT's format)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"--data {path}: no such file")
    if path.suffix == ".npy":
        arr = torch.from_numpy(np.load(path).astype(np.int64))
    elif path.suffix == ".pt":
        arr = torch.load(path, weights_only=True)
        if not torch.is_tensor(arr):
            raise ValueError(f"--data {path}: expected a saved tensor of token ids")
    elif path.suffix == ".bin":
        arr = torch.from_numpy(np.fromfile(path, dtype=np.uint16).astype(np.int64))
    else:
        raise ValueError(f"--data {path}: use .npy, .pt or .bin (uint16 token ids)")
    return arr.reshape(-1).long()


def batches(rows: int, seq_len: int, vocab: int, tokens: torch.Tensor | None = None,
            seed: int = 0) -> Iterator[torch.Tensor]:
    """Endless [rows, seq_len] batches: random windows of `tokens`, or of a small synthetic corpus
    (a fixed set of random sequences the model can learn, so the loss visibly falls)."""
    gen = torch.Generator().manual_seed(seed)
    if tokens is None:
        corpus = torch.randint(0, vocab, (max(4 * rows, 64), seq_len), generator=gen)
        while True:
            yield corpus[torch.randint(0, corpus.shape[0], (rows,), generator=gen)]
    if int(tokens.max()) >= vocab:
        raise ValueError(f"token ids go up to {int(tokens.max())} but the model's vocabulary has {vocab}")
    if tokens.numel() <= seq_len:
        raise ValueError(f"the data has {tokens.numel()} tokens, fewer than seq_len+1 = {seq_len + 1}")
    while True:
        starts = torch.randint(0, tokens.numel() - seq_len, (rows,), generator=gen)
        yield torch.stack([tokens[s:s + seq_len] for s in starts.tolist()])
