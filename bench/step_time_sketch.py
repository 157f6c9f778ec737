"""A first step-time model for SpeedLoader, against trials: a step as the sum of its work over this machine's
calibrated rates (sltune calibrate), each config measured by a real trial beside its prediction.

The sketch the step-time prior starts from. It counts, per sub-batch and decoder layer, the weight matmuls (at the
calibrated rate of their own shape and the nearest row count), causal attention, a dozen elementwise ops over the
hidden width and three over the MLP's, and two RMSNorms; a layer runs forward, recomputed and backward (twice the
forward); the head forward and backward; torch's AdamW over every parameter; the bytes the trial reports moving
(TrialResult.io) at the memcpy rate; 60 ops per layer and pass at the one-op cost. No overlap: on the CPU the
runtime's copies run inline. What it leaves out is what its error shows.

    python bench/step_time_sketch.py [--model llama-small] [--seq-len 128] [--rounds 2]

prints each config's measured and predicted step time and their ratio, then the median and 90th percentile of
|error| and Spearman's rank correlation over the configs. Run by hand (a few minutes), not in the suite.
"""

from __future__ import annotations

import argparse
import statistics

from sltune.machine import calibrate
from sltune.profiling import run_trial
from sltune.profiling.schema import TrialSpec
from sltune.tuning.cost.shape import shape_of
from sltune.tuning.cost.workload import layer_widths, workload_for

CONFIGS = [(1, 1, 1), (2, 2, 1), (4, 2, 2), (8, 1, 1), (1, 8, 4), (4, 4, 8), (2, 4, 2), (8, 2, 4)]   # (b, N, k)
OPS_PER_LAYER_PASS = 60


def spearman(xs: list[float], ys: list[float]) -> float:
    def ranks(v: list[float]) -> list[int]:
        order = sorted(range(len(v)), key=v.__getitem__)
        out = [0] * len(v)
        for rank, i in enumerate(order):
            out[i] = rank
        return out

    rx, ry = ranks(xs), ranks(ys)
    n = len(xs)
    return 1 - 6 * sum((a - b) ** 2 for a, b in zip(rx, ry)) / (n * (n * n - 1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama-small")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds of trials; the median step is kept")
    args = p.parse_args()
    seq, dtype = args.seq_len, "float32"
    shape = shape_of(args.model, dtype)
    h, layers, vocab = shape.hidden, shape.layers, shape.vocab
    widths = layer_widths(shape)
    workload = workload_for(shape, seq, (b * seq for b, _, _ in CONFIGS))
    head_dim = workload.head_dim
    rates = calibrate(workload)
    print(f"calibrated in {rates.seconds:.1f}s: {rates.fingerprint.describe()}")
    matmul = {(m.rows, m.k, m.n): m.flops.median for m in rates.matmul}
    attention = {a.batch: a.flops.median for a in rates.attention}
    elementwise, norm = rates.elementwise[dtype].median, rates.norm[dtype].median
    adamw, memcpy = rates.optimizer["torch.adamw"].median, rates.copies["host"].median
    op_s = 1 / rates.op_overhead.median

    def matmul_s(rows: int, k: int, n: int) -> float:
        nearest = min((key for key in matmul if key[1:] == (k, n)), key=lambda key: abs(key[0] - rows))
        return 2.0 * rows * k * n / matmul[nearest]

    predicted, parts = {}, {}
    for b, n, k in CONFIGS:
        rows = b * seq
        layer = sum(matmul_s(rows, h, w) for w in widths)
        layer += 4.0 * b * workload.heads * seq ** 2 * head_dim / attention[min(attention, key=lambda x: abs(x - b))]
        layer += (12 * rows * h + 3 * rows * max(widths)) / elementwise + 2 * rows * h / norm
        head = matmul_s(rows, h, vocab) + 3 * rows * vocab / elementwise
        compute = n * (layers * layer * 4 + head * 3)          # forward, recomputed, backward (twice the forward)
        parts[(b, n, k)] = {"compute": compute, "optimizer": shape.param_bytes / shape.itemsize / adamw,
                            "ops": n * layers * 4 * OPS_PER_LAYER_PASS * op_s}
    measured: dict[tuple[int, int, int], list[float]] = {c: [] for c in CONFIGS}
    for _ in range(args.rounds):                               # interleaved: A B C ... A B C
        for b, n, k in CONFIGS:
            r = run_trial(TrialSpec(model=args.model, dtype=dtype, sub_batch_size=b, num_sub_batches=n,
                                    num_live_blocks=k, seq_len=seq, steps=3, min_time_s=1.0, profile=False))
            measured[(b, n, k)].append(r.step_seconds)
            moved = sum(v for name, v in r.io.as_dict().items() if not name.startswith("disk"))
            parts[(b, n, k)]["copies"] = moved / memcpy
    errors, xs, ys = [], [], []
    for c in CONFIGS:
        predicted[c] = sum(parts[c].values())
        step = statistics.median(measured[c])
        errors.append(abs(predicted[c] / step - 1))
        xs.append(step)
        ys.append(predicted[c])
        shown = " ".join(f"{k} {v:.3f}" for k, v in parts[c].items())
        print(f"b={c[0]} N={c[1]} k={c[2]}: measured {step:.3f}s [{min(measured[c]):.3f}, {max(measured[c]):.3f}] "
              f"predicted {predicted[c]:.3f}s ({predicted[c] / step:.2f}x; {shown})")
    errors.sort()
    p90 = errors[min(len(errors) - 1, round(0.9 * (len(errors) - 1)))]
    print(f"|error| median {statistics.median(errors):.0%}, 90th percentile {p90:.0%}; Spearman {spearman(xs, ys):.2f}")


if __name__ == "__main__":
    main()
