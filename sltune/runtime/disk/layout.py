"""How the disk tier lays bytes out (sltune.runtime.disk.state): pages, blocks and the window's slots. Torch-free, so
the tuner's cost model counts a job's disk bytes and host window as the tier will hold them without importing torch."""

from __future__ import annotations

from typing import Callable, Sequence, TypeVar

PAGE = 4096                     # O_DIRECT reads and writes whole pages
BLOCK_NUMEL = 16 << 20          # values per block (a larger tensor is sliced into blocks of this many)
DEPTH = 3                       # slots: one read ahead, one stepping, one written behind
T = TypeVar("T")


def padded(nbytes: int) -> int:
    """Bytes rounded up to whole pages: what a file of nbytes of payload occupies and transfers."""
    return -(-nbytes // PAGE) * PAGE


def pieces(numel: int) -> list[tuple[int, int]]:
    """A tensor's slices, (start, numel), of BLOCK_NUMEL values but the last: a tensor larger than a block is
    stepped slice by slice, so the window's slots are a block's size, not the largest tensor's (a vocabulary's
    embedding: 233M values in qwen2-1.5b, 2.8 GB of master and AdamW state). Slices start at multiples of
    BLOCK_NUMEL, so an element-wise optimizer's vectorised loops see each value in the same lane as whole: the
    same bits (tests/unit/runtime/disk/test_layout.py)."""
    return [(a, min(BLOCK_NUMEL, numel - a)) for a in range(0, numel, BLOCK_NUMEL)] or [(0, 0)]


def pack(items: Sequence[T], numel: Callable[[T], int]) -> list[list[T]]:
    """Items in order, in blocks of at most BLOCK_NUMEL values (a larger item, when not sliced first, is a block of
    its own): how a unit's stepped tensors, sliced by `pieces`, go to files, and how the tuner's prior counts them
    (sltune.tuning.cost.prior)."""
    blocks: list[list[T]] = []
    current: list[T] = []
    size = 0
    for item in items:
        if current and size + numel(item) > BLOCK_NUMEL:
            blocks.append(current)
            current, size = [], 0
        current.append(item)
        size += numel(item)
    return blocks + ([current] if current else [])
