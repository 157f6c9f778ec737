"""Token batches for training: a file of token ids or text, or a synthetic corpus when there is none.

`batches` is the endless random-window stream trials measure with. `TokenBatches` is what a training job
reads: packed rows seen once per epoch in a seeded order, a held-out tail for evaluation, and a position
small enough to store in a checkpoint so a resumed job sees exactly the batches it would have seen.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from sltune.training.text import TEXT_SUFFIXES, tokenize_file   # light: transformers loads only to tokenize

_warned_narrow: set[Path] = set()


def load_tokens(path: str | Path, tokenizer: str | Path | None = None) -> torch.Tensor:
    """A 1-D stream of token ids from .npy, .pt or a raw uint16 .bin (nanoGPT's format), or from text
    (.txt, .jsonl, .parquet) tokenized by the Hugging Face tokenizer in folder `tokenizer`: each document's
    ids followed by EOS, cached beside the file (see sltune.training.text)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"--data {path}: no such file")
    if path.suffix in TEXT_SUFFIXES:
        if tokenizer is None:
            raise ValueError(f"--data {path} is text: pass --tokenizer FOLDER (a Hugging Face tokenizer saved with "
                             f"save_pretrained) to tokenize it")
        return torch.from_numpy(tokenize_file(path, tokenizer).ids.astype(np.int64))
    if path.suffix == ".npy":
        fix = "save the ids with np.save(path, ids.astype(np.int32))"
        with open(path, "rb") as fh:
            if fh.read(6) != b"\x93NUMPY":
                raise ValueError(f"--data {path}: not a NumPy .npy file (it lacks the .npy header); {fix}")
        try:
            arr = np.load(path, allow_pickle=False)
        except Exception as err:    # noqa: BLE001 - numpy raises ValueError, OSError, EOFError... for a foreign file
            why = "it holds pickled Python objects" if "pickle" in str(err) else _first_line(err)
            raise ValueError(f"--data {path}: not a NumPy .npy file of token ids ({why}); {fix}") from None
        if not isinstance(arr, np.ndarray):
            raise ValueError(f"--data {path}: not a NumPy .npy file of token ids; {fix}")
        _check_ids(path, arr.dtype, arr.dtype.kind in "iu", "np.save(path, ids.astype(np.int32))")
        arr = torch.from_numpy(arr.astype(np.int64))
    elif path.suffix == ".pt":
        try:
            arr = torch.load(path, weights_only=True)
        except Exception as err:    # noqa: BLE001 - torch raises pickle, zip and runtime errors for a foreign file
            raise ValueError(f"--data {path}: not a tensor saved with torch.save ({_first_line(err)}); save the "
                             f"ids with torch.save(ids.to(torch.int32), path)") from None
        if not torch.is_tensor(arr):
            raise ValueError(f"--data {path}: expected a saved tensor of token ids")
        integer = not arr.is_floating_point() and not arr.is_complex() and arr.dtype != torch.bool
        _check_ids(path, arr.dtype, integer, "torch.save(ids.to(torch.int32), path)")
    elif path.suffix == ".bin":
        size = path.stat().st_size
        if size % 2:
            raise ValueError(f"--data {path}: {size} bytes, an odd count, so not uint16 token ids (nanoGPT's .bin: "
                             f"ids.astype(np.uint16).tofile(path))")
        arr = torch.from_numpy(np.fromfile(path, dtype=np.uint16).astype(np.int64))
    else:
        raise ValueError(f"--data {path}: use token ids (.npy, .pt or uint16 .bin) or text (.txt, .jsonl or "
                         f".parquet, with --tokenizer)")
    return arr.reshape(-1).long()


def _check_ids(path: Path, dtype: Any, integer: bool, fix: str) -> None:
    """Token ids are integers: refuse any other dtype; warn (once per file) that narrow signed ids were cast."""
    name = str(dtype).removeprefix("torch.")
    if not integer:
        raise ValueError(f"--data {path}: holds {name} values, but token ids are integers; save them as integers: "
                         f"{fix}")
    if name in ("int8", "int16") and path not in _warned_narrow:
        _warned_narrow.add(path)
        top = 127 if name == "int8" else 32767
        warnings.warn(f"--data {path}: {name} token ids, read as int64; {name} holds ids up to {top} only, so ids "
                      f"of a larger vocabulary wrapped to negatives when the file was written (save them as uint16 "
                      f"or int32: {fix})", stacklevel=3)


def _first_line(err: Exception) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0]


def synthetic_corpus(rows: int, seq_len: int, vocab: int, gen: torch.Generator) -> torch.Tensor:
    """A fixed set of random [seq_len] sequences, enough for batches of `rows`, drawn from `gen`."""
    return torch.randint(0, vocab, (max(4 * rows, 64), seq_len), generator=gen)


def batches(rows: int, seq_len: int, vocab: int, tokens: torch.Tensor | None = None,
            seed: int = 0) -> Iterator[torch.Tensor]:
    """Endless [rows, seq_len] batches: random windows of `tokens`, or of a small synthetic corpus
    (a fixed set of random sequences the model can learn, so the loss visibly falls)."""
    gen = torch.Generator().manual_seed(seed)
    if tokens is None:
        corpus = synthetic_corpus(rows, seq_len, vocab, gen)
        while True:
            yield corpus[torch.randint(0, corpus.shape[0], (rows,), generator=gen)]
    if int(tokens.max()) >= vocab:
        raise ValueError(f"token ids go up to {int(tokens.max())} but the model's vocabulary has {vocab}")
    if tokens.numel() <= seq_len:
        raise ValueError(f"the data has {tokens.numel()} tokens, fewer than seq_len+1 = {seq_len + 1}")
    while True:
        starts = torch.randint(0, tokens.numel() - seq_len, (rows,), generator=gen)
        yield torch.stack([tokens[s:s + seq_len] for s in starts.tolist()])


class TokenBatches:
    """Endless [rows, seq_len] training batches over packed rows, in epochs, resumable from state_dict().

    The stream is cut into rows of `seq_len` consecutive tokens (non-overlapping; a tail shorter than
    seq_len is dropped). The last `holdout` fraction of rows (rounded down, at least one when holdout > 0)
    is held out for eval_batches() and never trained on. Each epoch visits the training rows in a fresh
    permutation drawn from (seed, epoch), `rows` at a time; the n_train % (rows * world) rows left at the end
    of an epoch's permutation are skipped, so no batch straddles two epochs and no row appears twice in one
    batch (they are other rows each epoch, as the permutation changes). With world > 1 every rank builds
    the stream with the same seed and takes its own `rows` of each step's rows * world, so ranks see
    disjoint rows. With tokens=None the rows are `batches`'s synthetic corpus for `seed`, treated the same.
    """

    def __init__(self, rows: int, seq_len: int, vocab: int, tokens: torch.Tensor | None = None, seed: int = 0,
                 holdout: float = 0.0, rank: int = 0, world: int = 1):
        if rows < 1 or seq_len < 1:
            raise ValueError(f"batch rows and --seq-len must be >= 1, got rows={rows}, seq_len={seq_len}")
        if not 0 <= holdout < 1:
            raise ValueError(f"--holdout must be a fraction in [0, 1), got {holdout}")
        if world < 1 or not 0 <= rank < world:
            raise ValueError(f"rank {rank} must be in [0, world={world})")
        self.rows, self.seq_len, self.vocab, self.holdout = rows, seq_len, vocab, holdout
        self.rank, self.world, self.synthetic = rank, world, tokens is None
        self.seed, self.epoch, self.cursor = seed, 0, 0
        if tokens is None:
            self._rows = synthetic_corpus(rows * world, seq_len, vocab, torch.Generator().manual_seed(seed))
        else:
            tokens = tokens.reshape(-1)
            if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= vocab):
                raise ValueError(f"token ids go up to {int(tokens.max())} (lowest {int(tokens.min())}) but the "
                                 f"model's vocabulary has {vocab}; use the model's own tokenizer")
            n = tokens.numel() // seq_len
            self._rows = tokens[:n * seq_len].long().reshape(n, seq_len)
        n_rows = self._rows.shape[0]
        self.eval_rows = _held_out(n_rows, holdout)
        self.train_rows = n_rows - self.eval_rows
        step = rows * world
        if self.train_rows < step:
            need = step
            while need - _held_out(need, holdout) < step:
                need += 1
            if self.synthetic:
                raise ValueError(f"--holdout {holdout} leaves {self.train_rows} of the {n_rows} synthetic rows to "
                                 f"train on, fewer than a batch of {step}; lower --holdout")
            raise ValueError(f"--data has {tokens.numel()} tokens: {n_rows} rows of --seq-len {seq_len}, "
                             f"{self.eval_rows} of them held out, too few for a batch of {step} rows; give at "
                             f"least {need * seq_len} tokens or lower --holdout, the batch size or --seq-len")
        self.steps_per_epoch = self.train_rows // step
        self._perm: tuple[int, np.ndarray] | None = None

    def __iter__(self) -> TokenBatches:
        return self

    def __next__(self) -> torch.Tensor:
        start = self.cursor + self.rank * self.rows
        batch = self._rows[torch.from_numpy(self._permutation()[start:start + self.rows])]
        self.cursor += self.rows * self.world
        if self.cursor + self.rows * self.world > self.train_rows:    # the rest would straddle: next epoch
            self.epoch, self.cursor = self.epoch + 1, 0
        return batch

    def _permutation(self) -> np.ndarray:
        if self._perm is None or self._perm[0] != self.epoch:
            rng = np.random.default_rng([self.seed % (1 << 64), self.epoch])
            self._perm = (self.epoch, rng.permutation(self.train_rows).astype(np.int64))
        return self._perm[1]

    def state_dict(self) -> dict[str, int]:
        """The data position, JSON-serialisable: the next batch is step `cursor / (rows * world)` of `epoch`."""
        return {"epoch": self.epoch, "cursor": self.cursor, "seed": self.seed,
                "train_rows": self.train_rows, "step_rows": self.rows * self.world}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a state_dict(): the next batches are those the saved stream would have yielded.
        The saved seed wins over the one this stream was built with."""
        try:
            epoch, cursor, seed = (int(state[k]) for k in ("epoch", "cursor", "seed"))
            train_rows, step_rows = int(state["train_rows"]), int(state["step_rows"])
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"data state {state!r} is not a TokenBatches.state_dict() (epoch, cursor, seed, "
                             f"train_rows, step_rows); resume from the checkpoint that wrote it") from None
        if (train_rows, step_rows) != (self.train_rows, self.rows * self.world):
            raise ValueError(f"the data position was saved for {train_rows} training rows taken {step_rows} a step, "
                             f"but this data gives {self.train_rows} taken {self.rows * self.world}; resume with "
                             f"the same --data, --seq-len, --holdout and batch size")
        if epoch < 0 or cursor < 0 or cursor + step_rows > train_rows:
            raise ValueError(f"data state epoch={epoch} cursor={cursor} is out of range for {train_rows} rows; "
                             f"resume from the checkpoint that wrote it")
        if self.synthetic and seed != self.seed:
            self._rows = synthetic_corpus(self.rows * self.world, self.seq_len, self.vocab,
                                          torch.Generator().manual_seed(seed))
        self.seed, self.epoch, self.cursor, self._perm = seed, epoch, cursor, None

    def eval_batches(self, rows: int, drop_last: bool = False) -> list[torch.Tensor]:
        """The held-out rows in order, `rows` at a time: every held-out row exactly once, the last batch
        smaller when `rows` does not divide them (weight each batch's mean loss by its rows for the mean);
        with drop_last, only full batches. Empty when holdout is 0. The same on every rank."""
        if rows < 1:
            raise ValueError(f"eval batch rows must be >= 1, got {rows}")
        held = self._rows[self.train_rows:]
        if drop_last and 0 < held.shape[0] < rows:
            raise ValueError(f"{held.shape[0]} held-out rows are fewer than an eval batch of {rows}; raise "
                             f"--holdout or evaluate in smaller batches")
        end = held.shape[0] - held.shape[0] % rows if drop_last else held.shape[0]
        return [held[i:i + rows].clone() for i in range(0, end, rows)]


def _held_out(n_rows: int, holdout: float) -> int:
    """Rows held out of n_rows: the fraction rounded down, at least one when holdout > 0 (and rows exist)."""
    return 0 if holdout == 0 or n_rows == 0 else max(1, int(holdout * n_rows))
