"""Generated tokens/s: SpeedLoader against its own resident bound and the peers, interleaved in one process.

    python bench/generate.py [--rows 16] [--configs 4x4,16x1] [--k 1,2] [--kv host] [--weights 0,1]
                             [--model llama-small] [--prompt 32] [--new 32] [--reps 5] [--threads 2]
                             [--no-peers] [--staged]

Runs, all on the same weights and left-padded prompts (one row unpadded):
  speedloader  b x N, k, kv_cache, weights_on_device (sltune; parameters in host memory, one unit loaded
               per step; /wS: the share S of them kept on the device for the whole call)
  resident     the same b x N and k with everything on the device: the no-I/O bound of that schedule
  staged-kv    (--staged) speedloader with the visible past staged on the device each step, the
               placement `host` takes beside a CUDA device: what delegation saves on the CPU
  transformers full batch, and once per sub-batch of b rows (what fits a device holding b rows)
  deepspeed    ZeRO-3 with parameter offload to the CPU, engine.module.generate (pip install '.[peers]')
  accelerate   accelerate.cpu_offload, model.generate

End-of-sequence stopping is off so every run generates rows*new tokens; the tokens of every run are
checked identical to transformers'. Runs are interleaved round by round (the order reversed every other
round) so machine noise hits them alike; figures are medians with min and max over the rounds.
"""

from __future__ import annotations

import argparse
import copy
import os
import socket
import statistics
import time
from typing import Callable

import sltune  # noqa: F401  (first: sets OMP_WAIT_POLICY before torch loads; OMP_WAIT_POLICY=ACTIVE to compare)
import torch

from sltune import SpeedLoaderConfig, SpeedLoaderEngine
from sltune.models import build, param_count
from sltune.runtime.kvcache import StagedHostKV
from sltune.sizes import format_bytes

Run = Callable[[], torch.Tensor]


def prompts(rows: int, length: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(3, vocab, (rows, length), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    for r in range(1, rows):
        mask[r, :r % (length // 2)] = 0
    return ids.masked_fill(mask == 0, 0), mask


def hf_runs(model, ids, mask, new: int, b: int) -> dict[str, Run]:
    def gen(m, i, a):
        return m.generate(i, attention_mask=a, max_new_tokens=new, do_sample=False)

    return {"transformers": lambda: gen(model, ids, mask),
            f"hf per {b} rows": lambda: torch.cat([gen(model, i, a) for i, a in zip(ids.split(b), mask.split(b))])}


def deepspeed_run(base, ids, mask, new: int) -> Run:
    """ZeRO-3, parameters offloaded to the CPU; a one-rank gloo group."""
    import deepspeed

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}}
    engine, *_ = deepspeed.initialize(model=copy.deepcopy(base), config=config)
    engine.module.eval()
    return lambda: engine.module.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False)


def accelerate_run(base, ids, mask, new: int) -> Run:
    from accelerate import cpu_offload

    model = cpu_offload(copy.deepcopy(base), execution_device=torch.device("cpu"))
    return lambda: model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-small")
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--configs", default=None, help="b x N pairs, e.g. 4x4,16x1 (default: rows/4 x 4 and rows x 1)")
    ap.add_argument("--k", default="1,2", help="live blocks to run, e.g. 1,2")
    ap.add_argument("--kv", default="host", help="kv_cache values to run: host, device or host,device")
    ap.add_argument("--weights", default="0,1", help="weights_on_device values to run, e.g. 0,0.5,1")
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2, help="torch intra-op threads for every run")
    ap.add_argument("--no-peers", action="store_true", help="skip DeepSpeed and accelerate")
    ap.add_argument("--staged", action="store_true", help="also run speedloader with the staged host KV cache")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    rows = args.rows
    configs = [tuple(int(x) for x in c.split("x")) for c in (args.configs or f"{max(1, rows // 4)}x{min(4, rows)},"
                                                                             f"{rows}x1").split(",")]
    if any(b * n != rows for b, n in configs):
        ap.error(f"--configs: every b x N must make --rows {rows}")
    base = build(args.model, seed=0).eval()
    base.generation_config.eos_token_id = None        # generate exactly --new tokens in every run
    base.generation_config.pad_token_id = 0
    ids, mask = prompts(rows, args.prompt, base.config.vocab_size)

    runs: dict[str, Run] = {}
    engines: dict[str, SpeedLoaderEngine] = {}
    for b, n in configs:
        for k in (int(x) for x in args.k.split(",")):
            variants = [("speedloader", kv, float(w), False) for kv in args.kv.split(",")
                        for w in args.weights.split(",")] + [("resident", "device", 0.0, False)]
            if args.staged:
                variants.append(("speedloader", "host", 0.0, True))
            for schedule, kv, w, staged in variants:
                cfg = SpeedLoaderConfig(sub_batch_size=b, num_sub_batches=n, num_live_blocks=k, schedule=schedule,
                                        kv_cache=kv, weights_on_device=w, memory_tracking="never")
                eng = SpeedLoaderEngine(copy.deepcopy(base), cfg, optimizer=None)
                label = "staged-kv" if staged else schedule if schedule == "resident" else \
                    f"speedloader/{kv}" + (f"/w{w:g}" if w else "")
                if staged:
                    eng.kv = StagedHostKV(eng.copier, eng.pool, eng.memory)
                name = f"{label} b{b}N{n}k{k}"
                engines[name] = eng
                runs[name] = (lambda e: lambda: e.generate(ids, attention_mask=mask, max_new_tokens=args.new,
                                                           eos_token_id=[]))(eng)
    hf = copy.deepcopy(base)
    runs.update(hf_runs(hf, ids, mask, args.new, min(b for b, _ in configs)))
    if not args.no_peers:
        for name, make in (("deepspeed zero3", deepspeed_run), ("accelerate", accelerate_run)):
            try:
                runs[name] = make(base, ids, mask, args.new)
            except ImportError as err:
                print(f"{name}: skipped ({err}); pip install '.[peers]'")

    print(f"model {args.model}: {param_count(args.model) / 1e6:.1f}M parameters, {rows} rows (left-padded), prompt "
          f"{args.prompt} + {args.new} new tokens, float32, greedy, torch threads {torch.get_num_threads()}, "
          f"{args.reps} interleaved rounds, OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}", flush=True)
    outputs = {name: run() for name, run in runs.items()}           # warm-up, and the tokens to compare
    print("warm-up done", flush=True)
    differ = [name for name, out in outputs.items() if not torch.equal(out, outputs["transformers"])]
    times: dict[str, list[float]] = {name: [] for name in runs}
    names = list(runs)
    for rep in range(args.reps):
        for name in names if rep % 2 == 0 else names[::-1]:
            start = time.perf_counter()
            runs[name]()
            times[name].append(time.perf_counter() - start)
        print(f"round {rep + 1}: " + ", ".join(f"{name} {times[name][-1]:.2f}s" for name in names), flush=True)
    tps = {name: rows * args.new / statistics.median(t) for name, t in times.items()}

    print(f"{'run':<34} {'tokens/s':>9} {'min':>8} {'max':>8} {'param load/call':>16} {'kv in / out per call':>22}")
    for name in names:
        lo, hi = rows * args.new / max(times[name]), rows * args.new / min(times[name])
        stats = engines[name].last_generation if name in engines else None
        load = format_bytes(stats.io.param_load_bytes) if stats else "-"
        kv = f"{format_bytes(stats.io.kv_load_bytes)} / {format_bytes(stats.io.kv_offload_bytes)}" if stats else "-"
        print(f"{name:<34} {tps[name]:>9.1f} {lo:>8.1f} {hi:>8.1f} {load:>16} {kv:>22}")
    print("tokens identical to transformers: " + ("all runs" if not differ else f"NO: {', '.join(differ)} differ"))
    peers = [p for p in ("transformers", "deepspeed zero3", "accelerate") if p in tps]
    print(f"{'ratio (median tokens/s)':<34} " + " ".join(f"{'÷ ' + p:>17}" for p in ["resident"] + peers))
    for name in names:
        if not name.startswith(("speedloader", "staged")):
            continue
        twin = "resident " + name.split(" ", 1)[1]
        cells = [tps[name] / tps[twin]] + [tps[name] / tps[p] for p in peers]
        print(f"{name:<34} " + " ".join(f"{c:>17.3f}" for c in cells))


if __name__ == "__main__":
    main()
