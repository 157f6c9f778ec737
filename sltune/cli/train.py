"""`sltune train`: train a model with the SpeedLoader runtime, with a progress bar and tokens/s."""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import torch
from tqdm import tqdm

from sltune.cli.common import add_knobs, config_from_args
from sltune.config import SpeedLoaderConfig
from sltune.data import batches, load_tokens
from sltune.runtime.memory import DeviceMemoryExceeded
from sltune.sizes import format_bytes
from sltune.yamlfile import read_yaml

DEFAULT_MODEL, DEFAULT_SEQ_LEN = "llama-tiny", 128


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="train with the SpeedLoader runtime",
                       description="Train a preset or config.json model (random init) on synthetic or given tokens.")
    p.add_argument("--config", help="a best-config YAML (sltune tune --out / sltune export): its model, seq_len, "
                                    "dtype and knobs are the defaults; flags override them")
    p.add_argument("--model", help=f"preset name or path to a transformers config.json (default: the --config "
                                   f"file's model, else {DEFAULT_MODEL})")
    p.add_argument("--seq-len", type=int, help=f"tokens per row (default: the --config file's workload.seq_len, "
                                               f"else {DEFAULT_SEQ_LEN})")
    p.add_argument("--steps", type=int, default=20, help="optimizer steps")
    p.add_argument("--data", help="token ids: .npy, .pt or uint16 .bin; synthetic when omitted")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate")
    p.add_argument("--seed", type=int, default=0, help="seeds the random weights and the batches")
    p.add_argument("--save", help="write the trained state_dict here (torch.save)")
    p.add_argument("--json", action="store_true", help="print a JSON summary instead of text")
    add_knobs(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from sltune import SpeedLoaderEngine
    from sltune.models import build

    tuned = read_yaml(args.config) if args.config else {}
    base = SpeedLoaderConfig.from_dict(tuned, source=args.config) if args.config else None
    cfg = config_from_args(args, base)
    model_source, model_name = _model(args, tuned)
    seq_len = args.seq_len or _tuned_seq_len(tuned) or DEFAULT_SEQ_LEN
    if args.steps < 1 or seq_len < 2:
        raise ValueError("--steps must be >= 1 and --seq-len >= 2")
    rank, world = _join_torchrun(cfg)
    model = build(model_source, seed=args.seed)
    model.train()
    engine = SpeedLoaderEngine(model, cfg, optimizer=lambda ps: torch.optim.AdamW(ps, lr=args.lr))
    tokens = load_tokens(args.data) if args.data else None
    data = batches(cfg.effective_batch_size, seq_len, model.config.vocab_size, tokens, seed=args.seed + rank)
    quiet = args.json or rank != 0

    results = []
    start = time.perf_counter()
    bar = tqdm(range(args.steps), desc=f"train {model_name} s={seq_len} ({cfg.schedule} b={cfg.sub_batch_size} "
               f"N={cfg.num_sub_batches} k={cfg.num_live_blocks}" + (f" x{world} ranks" if world > 1 else "") + ")",
               unit="step", disable=quiet)
    for _ in bar:
        try:
            res = engine.train_step(next(data))
        except DeviceMemoryExceeded as err:
            bar.close()
            raise ValueError(f"{err} ({_limit_source(args)})") from None
        results.append(res)
        bar.set_postfix(loss=f"{res.loss:.4f}", tok_s=f"{res.tokens / res.seconds:,.0f}")
    wall = time.perf_counter() - start
    timed = results[1:] or results   # the first step warms up (and measures device memory)
    summary = {
        "model": model_name, "seq_len": seq_len, "config": cfg.to_dict(), "steps": len(results), "world_size": world,
        "first_loss": results[0].loss, "final_loss": results[-1].loss,
        "tokens_per_s": sum(r.tokens for r in timed) / sum(r.seconds for r in timed),
        "wall_seconds": wall, "peak_device_bytes": results[0].peak_device_bytes,
        "io_per_step": results[-1].io.as_dict(),
    }
    state = engine.state_dict() if args.save else None      # a collective when sharded: every rank calls it
    if world > 1:
        import torch.distributed as dist

        dist.destroy_process_group()
    if rank != 0:
        return 0
    if args.save:
        torch.save(state, args.save)
    if args.json:
        print(json.dumps(summary))
    else:
        io = results[-1].io
        ranks = f" on each of {world} ranks" if world > 1 else ""
        print(f"trained {len(results)} steps in {wall:.1f}s: loss {summary['first_loss']:.4f} -> "
              f"{summary['final_loss']:.4f}, {summary['tokens_per_s']:,.0f} tokens/s{ranks}")
        print(f"per step: params loaded {format_bytes(io.param_load_bytes)}, grads offloaded "
              f"{format_bytes(io.grad_offload_bytes)}, activations {format_bytes(io.act_offload_bytes)} out / "
              f"{format_bytes(io.act_load_bytes)} in; device peak {format_bytes(summary['peak_device_bytes'])}")
    return 0


def _model(args: argparse.Namespace, tuned: dict[str, Any]) -> tuple[Any, str]:
    """What to build and what to call it: --model, else the model the config was tuned on (a preset or an
    inline config.json, as the job's spec gave it), else the default preset."""
    if args.model:
        return args.model, args.model
    model = (tuned.get("provenance") or {}).get("model") or {}
    if model.get("preset"):
        return model["preset"], model["preset"]
    if model.get("hf_config"):
        return model["hf_config"], f"{model['hf_config'].get('model_type', 'model')} (inline config in {args.config})"
    return DEFAULT_MODEL, DEFAULT_MODEL


def _tuned_seq_len(tuned: dict[str, Any]) -> int | None:
    workload = tuned.get("workload") or {}
    return workload.get("seq_len") if workload.get("mode", "train") == "train" else None


def _limit_source(args: argparse.Namespace) -> str:
    if args.device_memory_limit is None and args.config:
        return f"the limit is device_memory_limit in {args.config}; override it with --device-memory-limit"
    return "the limit is --device-memory-limit"


def _join_torchrun(cfg: SpeedLoaderConfig) -> tuple[int, int]:
    """Under torchrun (WORLD_SIZE > 1 in the environment) join the process group: the engine then shards
    parameters over the ranks, each of which trains on its own rows."""
    import os

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return 0, 1
    import torch.distributed as dist

    backend = "nccl" if cfg.device.startswith("cuda") else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend)
    return dist.get_rank(), world
