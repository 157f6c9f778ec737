"""Tokens/s of a plain PyTorch accumulation loop and sltune's schedules x activations, side by side.

    python bench/runtime.py [--model llama-small] [--b 1] [--seq 32] [--n 8] [--k 1] [--rounds 5]

Every runner starts from the same weights and trains on the same batches in the same order, with AdamW, so
their losses must agree step by step (checked). Rounds are interleaved (each round runs every runner once,
the order alternating) so machine noise hits them alike; each figure is the median step time over the rounds
with its min and max. A target's ratio is printed twice: of the medians, and as the median over rounds of
each round's ratio (the two runners measured side by side) with its 95% bootstrap interval; a target is
"met" when the interval lies above it, "not met" below it, else "within the noise". Targets (issue #11):
resident >= 0.97x plain; speedloader offload >= 0.92x and recompute >= 0.85x plain at k=1; speedloader's
best >= 1.2x canonical.

"plain + forced recompute" is the plain loop doing, besides, the work `activations: recompute` is there to
do: a no-grad forward of all groups but the last per micro-batch. It is recompute's bound at this k, so
it shows whether speedloader/recompute is short of the bound or the bound is short of the target.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from sltune import SpeedLoaderConfig, SpeedLoaderEngine
from sltune.models import build, param_count
from sltune.profiling.stats import paired_ratio_ci

LR = 1e-4
MIN_ROUNDS = 5      # fewer rounds print the ratio of medians without an interval or a verdict
SLTUNE = [("resident", "recompute"), ("speedloader", "recompute"), ("speedloader", "offload"),
          ("canonical", "recompute"), ("canonical", "offload")]


@dataclass
class Runner:
    """One way of training: step(batch) -> loss; the runner's times and losses are recorded."""

    name: str
    step: Callable[[torch.Tensor], float]
    seconds: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    io: object = None
    model: object = None
    engine: object = None

    def run(self, batch: torch.Tensor, timed: bool) -> None:
        start = time.perf_counter()
        loss = self.step(batch)
        elapsed = time.perf_counter() - start
        self.losses.append(loss)
        if timed:
            self.seconds.append(elapsed)


def plain_loop(model: torch.nn.Module, b: int, n: int) -> Runner:
    """The bound: the model as is, one micro-batch of b rows at a time, gradients accumulated, one step."""
    model = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)

    def step(batch: torch.Tensor) -> float:
        total = 0.0
        for i in range(n):
            mb = batch[i * b:(i + 1) * b]
            loss = model(input_ids=mb, labels=mb).loss / n     # equal token counts: the mean over the batch
            loss.backward()
            total += loss.item()
        opt.step()
        opt.zero_grad()
        return total
    runner = Runner("plain loop", step)
    runner.model = model
    return runner


def forced_recompute(model: torch.nn.Module, b: int, n: int, k: int) -> Runner | None:
    """The plain loop plus the work `activations: recompute` cannot avoid: per micro-batch, a no-grad forward
    of every group but the last (the turnaround's), i.e. the embedding and layers [0, L - k) once more. Its
    tokens/s is the bound of speedloader/recompute at this k; None for a model without model.layers."""
    runner = plain_loop(model, b, n)
    inner = getattr(runner.model, "model", None)
    if inner is None or not hasattr(inner, "layers"):
        return None
    trunc = copy.copy(inner)               # shares every weight with the plain loop's model
    trunc._modules = dict(inner._modules)
    trunc.layers = torch.nn.ModuleList(list(inner.layers)[:len(inner.layers) - k])
    plain_step = runner.step

    def step(batch: torch.Tensor) -> float:
        with torch.no_grad():
            for i in range(n):
                trunc(input_ids=batch[i * b:(i + 1) * b])
        return plain_step(batch)
    return Runner("plain + forced recompute", step)


def sltune_runner(model: torch.nn.Module, b: int, n: int, k: int, schedule: str, activations: str) -> Runner:
    cfg = SpeedLoaderConfig(sub_batch_size=b, num_sub_batches=n, num_live_blocks=k, schedule=schedule,
                            activations=activations, memory_tracking="never")
    engine = SpeedLoaderEngine(copy.deepcopy(model), cfg, optimizer=lambda ps: torch.optim.AdamW(ps, lr=LR))
    name = schedule if schedule == "resident" else f"{schedule}/{activations}"
    runner = Runner(name, lambda batch: 0.0)
    runner.engine = engine

    def step(batch: torch.Tensor) -> float:
        res = engine.train_step(batch)
        runner.io = res.io
        return res.loss
    runner.step = step
    return runner


def offload_in_place(model: torch.nn.Module, b: int, n: int, k: int) -> Runner:
    """speedloader/offload with its saved tensors left where autograd put them: no activation copies, the rest
    of the schedule as is. A diagnostic, not a config (device memory grows with N): against
    speedloader/offload it is what the copies cost, against the plain loop what the rest costs."""
    runner = sltune_runner(model, b, n, k, "speedloader", "offload")
    runner.name = "offload, copies skipped"
    runner.engine.saved.host = False
    return runner


def interleave(runners: list[Runner], batches: list[torch.Tensor], rounds: int, warmup: int) -> None:
    """Warm-up steps, then `rounds` rounds, every runner once per round, the order alternating."""
    step = 0
    for r in range(warmup + rounds):
        order = runners if r % 2 == 0 else runners[::-1]
        for runner in order:
            runner.run(batches[step % len(batches)], timed=r >= warmup)
        step += 1


def check_losses(runners: list[Runner], rtol: float = 1e-3) -> None:
    """Same weights, same batches, same optimizer: every runner's loss, step by step, as the first's. Prints
    each runner's largest relative deviation; one beyond rtol is flagged (the timings still print)."""
    ref = runners[0]
    print(f"losses of {ref.name} over {len(ref.losses)} steps: {ref.losses[0]:.4f} -> {ref.losses[-1]:.4f}; "
          f"largest relative deviation from it, first step and last step:")
    for runner in runners[1:]:
        dev = [abs(a - b) / abs(a) for a, b in zip(ref.losses, runner.losses)]
        flag = "ok" if max(dev) <= rtol else f"DISAGREES beyond {rtol:g}"
        print(f"  {runner.name:<24} max {max(dev):.1e}  first {dev[0]:.1e}  last {dev[-1]:.1e}  {flag}")


def report(runners: list[Runner], tokens: int, ratios: list[tuple[str, str, float]]) -> None:
    print(f"{'runner':<24} {'tokens/s':>9} {'(min':>8} {'max)':>8} {'median s':>9}  vs plain")
    med = {r.name: statistics.median(r.seconds) for r in runners}
    plain = med.get("plain loop")
    for r in runners:
        vs = f"{plain / med[r.name]:.3f}x" if plain else ""
        print(f"{r.name:<24} {tokens / med[r.name]:>9.1f} {tokens / max(r.seconds):>8.1f} {tokens / min(r.seconds):>8.1f} "
              f"{med[r.name]:>9.3f}  {vs}")
    by_name = {r.name: r for r in runners}
    for a, b, target in ratios:
        if a not in med or b not in med:
            continue
        rounds = len(by_name[a].seconds)
        if rounds < MIN_ROUNDS:         # a bootstrap of 2 or 3 rounds is narrower than what it measures
            print(f"{a} / {b} = {med[b] / med[a]:.3f}   (target >= {target}; {rounds} rounds: "
                  f"{MIN_ROUNDS} give an interval)")
            continue
        point, (lo, hi) = paired_ratio_ci([[t] for t in by_name[b].seconds], [[t] for t in by_name[a].seconds])
        verdict = "met" if lo >= target else "not met" if hi < target else "within the noise"
        print(f"{a} / {b} = {med[b] / med[a]:.3f}; per round {point:.3f} [{lo:.3f}, {hi:.3f}]   "
              f"(target >= {target}: {verdict})")


def setup(argv=None) -> tuple[argparse.Namespace, torch.nn.Module, list[torch.Tensor]]:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-small")
    ap.add_argument("--b", type=int, default=1)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--k", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--offload-in-place", action="store_true",
                    help="also run speedloader/offload without its activation copies: what they cost")
    args = ap.parse_args(argv)
    base = build(args.model, seed=0)
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, base.config.vocab_size, (args.b * args.n, args.seq), generator=gen)
               for _ in range(4)]
    print(f"model {args.model}: {param_count(args.model) / 1e6:.1f}M parameters, float32, b={args.b} s={args.seq} "
          f"N={args.n} k={args.k}, AdamW, torch threads {torch.get_num_threads()}, {args.rounds} interleaved rounds")
    return args, base, batches


def sltune_runners(base, args) -> list[Runner]:
    return [sltune_runner(base, args.b, args.n, args.k, s, a) for s, a in SLTUNE]


def best_speedloader(runners: list[Runner]) -> str:
    sl = [r for r in runners if r.name.startswith("speedloader/")]
    return min(sl, key=lambda r: statistics.median(r.seconds)).name


def targets(best: str) -> list[tuple[str, str, float]]:
    """(runner, baseline, target throughput ratio) from issue #11."""
    return [("resident", "plain loop", 0.97), ("speedloader/offload", "plain loop", 0.92),
            ("speedloader/recompute", "plain loop", 0.85),
            ("speedloader/recompute", "plain + forced recompute", 0.97),
            ("plain + forced recompute", "plain loop", 0.85), (best, "canonical/recompute", 1.2),
            (best, "canonical/offload", 1.2)]


def main() -> None:
    args, base, batches = setup()
    bound = forced_recompute(base, args.b, args.n, args.k)
    runners = [plain_loop(base, args.b, args.n), *([bound] if bound else []), *sltune_runners(base, args)]
    if args.offload_in_place:
        runners.append(offload_in_place(base, args.b, args.n, args.k))
    interleave(runners, batches, args.rounds, args.warmup)
    check_losses(runners)
    report(runners, args.b * args.n * args.seq, targets(best_speedloader(runners)))
    for r in runners:
        if r.io is not None:
            print(f"  {r.name:<24} param load {r.io.param_load_bytes / 2**20:8.1f} MiB  activations out+in "
                  f"{(r.io.act_offload_bytes + r.io.act_load_bytes) / 2**20:8.1f} MiB")


if __name__ == "__main__":
    main()
