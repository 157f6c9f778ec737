"""Machine rates written by hand (sltune.machine.rates), round figures so that a step time predicted from them can
be checked by hand: the step-time prior's tests and plan's."""

from __future__ import annotations

from datetime import datetime, timezone

from sltune.machine.fingerprint import Fingerprint
from sltune.machine.rates import AttentionRate, DecodeAttentionRate, MachineRates, MatmulRate, Rate
from sltune.tuning.cost.shape import shape_of
from sltune.tuning.cost.workload import workload_for

SEQ = 48                    # no width of llama-tiny (64, 32, 176): a weight gradient's k is the rows


def rate(median: float, spread: float = 0.0) -> Rate:
    return Rate(median=median, low=median * (1 - spread), high=median * (1 + spread), samples=3, unit="x")


def rates_for(model: str = "llama-tiny", device: str = "cpu", spread: float = 0.0, copy: float = 1e9,
              seq: int = SEQ, **changes) -> MachineRates:
    """Rates at every shape of `model` at `seq` tokens per row (and a generate call's decode steps at 1 and 8 rows):
    1e9 FLOP/s and elements/s, `copy` bytes/s."""
    w = workload_for(shape_of(model, "float32"), seq, (seq, 8 * seq))
    copies = {"host": rate(copy, spread)} if device == "cpu" else \
        {f"{d}.pinned": rate(copy, spread) for d in ("h2d", "d2h")}
    out = MachineRates(
        fingerprint=Fingerprint(cpu="test", cores=2, memory_bytes=1 << 30, gpus=(), torch="test"),
        measured_at=datetime.now(timezone.utc), seconds=1.0, device=device, threads=2,
        matmul=[MatmulRate(rows=r, k=k, n=n, dtype="float32", flops=rate(1e9, spread)) for k, n in w.matmuls
                for r in (1, 8, *w.rows)]        # each weight's forward, and its gradient (out x rows @ rows x in)
        + [MatmulRate(rows=n, k=r, n=k, dtype="float32", flops=rate(1e9, spread)) for k, n in w.matmuls
           for r in w.rows],
        attention=[AttentionRate(batch=r // seq, heads=w.heads, seq=seq, head_dim=w.head_dim, dtype="float32",
                                 flops=rate(1e9, spread)) for r in w.rows],
        decode_attention=[DecodeAttentionRate(batch=b, heads=w.heads, past=seq, head_dim=w.head_dim, dtype="float32",
                                              flops=rate(1e9, spread)) for b in (1, 8)],
        elementwise={"float32": rate(1e9, spread)}, norm={"float32": rate(1e9, spread)},
        optimizer={"torch.adamw": rate(1e8, spread)}, copies=copies, op_overhead=rate(1e5, spread))
    return out.model_copy(update=changes)
