"""What calibrate measures at (light: a plan names the rates it looks for without loading torch)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class Workload:
    """What to measure at: a model's matmuls (k, n) in its dtype, its attention geometry, and the row counts its
    tuning space spans (sub_batch_size x seq_len). The default is llama-small's shape at seq_len 128."""

    matmuls: tuple[tuple[int, int], ...] = ((512, 512), (512, 1408), (1408, 512), (512, 8192))
    rows: tuple[int, ...] = (128, 1024)
    hidden: int = 512
    heads: int = 8
    head_dim: int = 64
    seq_len: int = 128
    dtype: str = "float32"
    param_numels: tuple[int, ...] = field(default=())
    """one decoder layer's parameter sizes: the optimizer is timed on tensors of these sizes (default: one of 4M)"""
    decode_rows: tuple[int, ...] = ()
    """generation's: the rows of one sub-batch's decode step (its sub_batch_size: one new token a row), at which the
    matmuls and the decode attention are timed too (empty: training, whose backward's matmuls are timed instead)"""
    kv_len: int = 0
    """generation's: the positions a decode step's attention reads at most (prompt_len + new_tokens)"""

    @property
    def generation(self) -> bool:
        return bool(self.decode_rows)

    @property
    def key(self) -> str:
        """Names the workload in the job store: rates are kept per machine and workload (a training workload's
        key leaves out the generation fields, so rates stored before they existed are still found)."""
        named = {k: v for k, v in asdict(self).items() if self.generation or k not in ("decode_rows", "kv_len")}
        return hashlib.sha256(json.dumps(named, sort_keys=True).encode()).hexdigest()[:16]
