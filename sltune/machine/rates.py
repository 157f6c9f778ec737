"""A machine's measured rates, as calibrate returns them and as they are stored: each a median with the slowest and
fastest sample beside it, so what is predicted from them carries an interval."""

from __future__ import annotations

import statistics
from datetime import datetime
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from sltune.machine.fingerprint import Fingerprint


class Rate(BaseModel):
    """Work per second over repeated timings: the median, and the lowest and highest sample."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    median: float = Field(gt=0)
    low: float = Field(gt=0)
    high: float = Field(gt=0)
    samples: int = Field(ge=1)
    unit: str
    """what is counted per second: FLOP, elements, bytes, ops"""

    @classmethod
    def of(cls, values: list[float], unit: str) -> "Rate":
        return cls(median=statistics.median(values), low=min(values), high=max(values), samples=len(values),
                   unit=unit)

    @property
    def spread(self) -> float:
        """(high - low) / median: how far apart this machine's samples were."""
        return (self.high - self.low) / self.median


class MatmulRate(BaseModel):
    """A (rows x k) @ (k x n) matmul in dtype: a decoder layer's projection or the head, at a row count the
    tuning space spans (sub_batch_size x seq_len)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    rows: int
    k: int
    n: int
    dtype: str
    flops: Rate


class AttentionRate(BaseModel):
    """scaled_dot_product_attention, causal, over (batch, heads, seq, head_dim) in dtype: 4 x b x h x s^2 x d FLOP
    forward (counted in full; the causal half is the kernel's business)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    batch: int
    heads: int
    seq: int
    head_dim: int
    dtype: str
    flops: Rate


class DecodeAttentionRate(BaseModel):
    """scaled_dot_product_attention of one query position per row over `past` positions of keys and values, in
    dtype: a decode step's, 4 x b x h x past x d FLOP (read-bound: the keys and values once)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    batch: int
    heads: int
    past: int
    head_dim: int
    dtype: str
    flops: Rate


class MachineRates(BaseModel):
    """Everything `sltune calibrate` measured on one machine, with the threads and device it measured on."""

    model_config = ConfigDict(extra="forbid")

    fingerprint: Fingerprint
    measured_at: datetime
    seconds: float
    """how long the calibration took"""
    device: str
    """where the compute ran: cpu, or cuda:N"""
    threads: int
    """torch's intra-op threads during the calibration"""
    matmul: list[MatmulRate] = []
    attention: list[AttentionRate] = []
    decode_attention: list[DecodeAttentionRate] = []
    """generation's (calibrated at a generate spec): a decode step's attention at each sub_batch_size"""
    elementwise: dict[str, Rate] = {}
    """per dtype: an add of two of a layer's activations (rows x hidden), elements per second"""
    norm: dict[str, Rate] = {}
    """per dtype: RMSNorm over rows of `hidden`, elements per second"""
    optimizer: dict[str, Rate] = {}
    """per optimizer ("torch.adamw" or "torch.sgd" as the runtime builds the spec's, fused; "deepspeed.cpu_adam"
    where it is built), float32 on the host: parameters stepped per second"""
    copies: dict[str, Rate] = {}
    """host<->device copies, bytes per second: "h2d.pinned", "d2h.pageable", ...; on the CPU "host" (memcpy between
    host tensors, what the CPU device and the emulated one do) and "host.fresh" (into a new buffer each time, its
    pages faulted in: what a wrapper's flat buffers made each step cost)"""
    disk: dict[str, Rate] = {}
    """"write" (flushed) and "read" through the engine's own files (O_DIRECT where the folder allows), bytes per
    second"""
    disk_direct: bool | None = None
    """whether the disk rates went through O_DIRECT (None: not measured)"""
    op_overhead: Rate | None = None
    """the fixed cost of one small op, ops per second (1 / seconds per op)"""
    collectives: dict[str, Rate] = {}
    """"all_gather.W" and "reduce_scatter.W" over W ranks: the whole gathered tensor's bytes per second"""
    collective_backend: str | None = None
    """the process group they ran over: gloo on the CPU, nccl on GPUs"""

    def where(self) -> str:
        """The machine, device and threads measured on, as one line."""
        return f"{self.fingerprint.describe()}; {self.device}, {self.threads} threads"

    def shown(self) -> list[tuple[str, str, str, str, str, int]]:
        """Every rate as people read it: (what, median, slowest, fastest, unit, samples), scaled to the unit."""
        rows = [(f"matmul {m.rows}x{m.k} @ {m.k}x{m.n} {m.dtype}", m.flops, 1e9, "GFLOP/s") for m in self.matmul]
        rows += [(f"attention b={a.batch} h={a.heads} s={a.seq} d={a.head_dim} {a.dtype}", a.flops, 1e9, "GFLOP/s")
                 for a in self.attention]
        rows += [(f"decode attention b={a.batch} h={a.heads} past={a.past} d={a.head_dim} {a.dtype}", a.flops, 1e9,
                  "GFLOP/s") for a in self.decode_attention]
        rows += [(f"elementwise {d}", r, 1e9, "G elements/s") for d, r in self.elementwise.items()]
        rows += [(f"rms_norm {d}", r, 1e9, "G elements/s") for d, r in self.norm.items()]
        rows += [(f"optimizer {n}", r, 1e6, "M parameters/s") for n, r in self.optimizer.items()]
        rows += [(f"copy {n}", r, 2**30, "GiB/s") for n, r in self.copies.items()]
        direct = " (O_DIRECT)" if self.disk_direct else ""
        rows += [(f"disk {n}{direct}", r, 2**30, "GiB/s") for n, r in self.disk.items()]
        for name, rate in self.collectives.items():
            op, world = name.rsplit(".", 1)
            rows.append((f"{op} over {world} ranks ({self.collective_backend})", rate, 2**30, "GiB/s"))
        if self.op_overhead:
            rows.append(("one op", self.op_overhead, 1e6, "M ops/s"))
        return [(what, f"{r.median / scale:,.2f}", f"{r.low / scale:,.2f}", f"{r.high / scale:,.2f}", unit, r.samples)
                for what, r, scale, unit in rows]

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.model_dump_json(indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> "MachineRates":
        """Rates from a file calibrate wrote; an unreadable one names the file and how to make it."""
        try:
            return cls.model_validate_json(Path(path).read_text())
        except OSError as err:
            raise ValueError(f"{path}: {err.strerror}: write it with `sltune calibrate --out {path}`") from None
