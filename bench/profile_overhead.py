"""Does profiling distort the measurement? Trials with and without the profiled step, interleaved.

    python bench/profile_overhead.py [--model llama-small] [--reps 4]

Target (issue #3): tokens/s within 10% with and without the profiled step. Also prints how much the
profiler slows the profiled step itself (that step is only used for the breakdown, never for tokens/s).
"""

from __future__ import annotations

import argparse
import statistics

from sltune.profiling import run_trial


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-small")
    ap.add_argument("--b", type=int, default=1)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--reps", type=int, default=4)
    args = ap.parse_args()
    spec = dict(model=args.model, sub_batch_size=args.b, num_sub_batches=args.n, seq_len=args.seq, steps=args.steps)
    runs = {True: [], False: []}
    profiled_step = []
    for rep in range(args.reps):
        for profile in ((True, False) if rep % 2 == 0 else (False, True)):
            r = run_trial({**spec, "profile": profile})
            assert r.status == "ok", r.error
            runs[profile].append(r.tokens_per_s)
            if profile:
                profiled_step.append(args.b * args.n * args.seq / r.profiled_step_seconds)
    with_p, without = statistics.median(runs[True]), statistics.median(runs[False])
    print(f"{args.model} b={args.b} N={args.n} s={args.seq}, {args.reps} trials each, medians:")
    print(f"  tokens/s with the profiled step    {with_p:10.1f}   {[round(x, 1) for x in runs[True]]}")
    print(f"  tokens/s without it                {without:10.1f}   {[round(x, 1) for x in runs[False]]}")
    print(f"  ratio with/without                 {with_p / without:10.3f}   (target within 0.90..1.10)")
    print(f"  the profiled step itself           {statistics.median(profiled_step):10.1f} tokens/s "
          f"({statistics.median(profiled_step) / without:.2f}x: the profiler's own cost, not in tokens/s)")


if __name__ == "__main__":
    main()
