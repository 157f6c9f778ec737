"""`sltune train`: train a model with the SpeedLoader runtime: a preset or a Hugging Face folder in, a Hugging
Face folder out, with a schedule, clipping, evaluation, metrics, checkpoints and exact resume
(sltune.training.loop); a progress bar and tokens/s."""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING, Any, NoReturn

from tqdm import tqdm

from sltune.cli.common import add_knobs, as_flags, config_from_args
from sltune.config import SpeedLoaderConfig, param_offload_refusal
from sltune.sizes import format_bytes
from sltune.training.optimizer import OptimizerConfig
from sltune.training.schedule import SCHEDULES
from sltune.yamlfile import read_yaml

if TYPE_CHECKING:
    from sltune.runtime.memory import DeviceMemoryExceeded
    from sltune.training.loop import Inputs, TrainJob
    from sltune.tuning.cost.setup import Setup
    from sltune.tuning.space import Candidate

DEFAULT_MODEL, DEFAULT_SEQ_LEN, DEFAULT_HOLDOUT = "llama-tiny", 128, 0.05
# the device prior of the smallest config (b=1 N=1 k=1) against its measured first step, on llama-tiny and gpt2-tiny,
# float32 and bfloat16, every schedule, seq_len 16 and 128: 0.986-1.013 of it. A limit less than this share below
# the prior is left to the step, which measures: the prior's own error refuses no limit a step would meet
PRIOR_MARGIN = 0.02
RANK0_GRACE_S = 5.0     # how long a rank other than 0 waits for torchrun to stop it after rank 0 refused the run
OPTIMIZER_FLAGS = {"name": "optimizer", "lr": "lr", "eps": "eps", "weight_decay": "weight_decay",
                   "momentum": "momentum"}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="train with the SpeedLoader runtime",
                       description="Train a preset, a config.json (random weights) or a Hugging Face model folder "
                                   "(its weights) on synthetic tokens, token files or text; write a Hugging Face "
                                   "folder with --save, resume exactly with --resume.")
    p.add_argument("--config", help="a best-config YAML (sltune tune --out / sltune export): its model, seq_len, "
                                    "dtype, knobs and optimizer are the defaults; flags override them. Its backend "
                                    "(deepspeed, fsdp) trains instead of the SpeedLoader runtime when it names one")
    p.add_argument("--model", help=f"preset name, a transformers config.json (random weights), or a Hugging Face "
                                   f"model folder whose safetensors are loaded (default: the --config file's model, "
                                   f"else {DEFAULT_MODEL})")
    p.add_argument("--seq-len", type=int, help=f"tokens per row (default: the --config file's workload.seq_len, "
                                               f"else {DEFAULT_SEQ_LEN})")
    p.add_argument("--steps", type=int, default=20, help="optimizer steps in all: a --resume runs the rest")
    p.add_argument("--data", help="token ids (.npy, .pt, uint16 .bin) or text (.txt, .jsonl with a 'text' field, "
                                  ".parquet with a 'text' column; tokenized and cached beside it); synthetic when "
                                  "omitted")
    p.add_argument("--tokenizer", help="the Hugging Face tokenizer folder for text --data (default: --model's "
                                       "folder)")
    p.add_argument("--holdout", type=float, help=f"share of --data's rows held out for --eval-every (default: "
                                                 f"{DEFAULT_HOLDOUT} with --eval-every, else 0)")
    p.add_argument("--seed", type=int, default=0, help="seeds random weights and the data order")
    opt = p.add_argument_group("optimizer (default: the --config file's optimizer section, else AdamW)")
    opt.add_argument("--optimizer", choices=["adamw", "sgd"], help="adamw | sgd")
    opt.add_argument("--lr", type=float, help=f"the peak learning rate (default {OptimizerConfig().lr:g})")
    opt.add_argument("--weight-decay", type=float, help="decoupled weight decay (AdamW; default 0.01) or L2 (SGD; "
                                                        "default 0)")
    opt.add_argument("--eps", type=float, help="AdamW's eps (default 1e-8)")
    opt.add_argument("--momentum", type=float, help="SGD's momentum (default 0)")
    opt.add_argument("--warmup-steps", type=int, default=0, help="linear warmup from 0 to --lr")
    opt.add_argument("--lr-schedule", choices=SCHEDULES, default="constant",
                     help="after warmup: constant, linear or cosine decay to --min-lr (transformers' schedules)")
    opt.add_argument("--min-lr", type=float, default=0.0, help="where linear and cosine decay end")
    opt.add_argument("--max-grad-norm", type=float, help="clip the global gradient norm (over every rank) to this")
    out = p.add_argument_group("evaluation, metrics and checkpoints")
    out.add_argument("--eval-every", type=int, help="evaluate the mean loss on the held-out rows every K steps")
    out.add_argument("--log", "--log-jsonl", dest="log",
                     help="append a JSON line per step here: step, loss, lr, grad_norm, tokens_per_s, loss_scale, "
                          "skipped (and eval_loss). Under torchrun write --log-jsonl: torchrun takes --log as the "
                          "start of its own --log-dir")
    out.add_argument("--save", help="write a Hugging Face folder here at the end (config.json, safetensors, the "
                                    "tokenizer files), with the state --resume needs")
    out.add_argument("--save-every", type=int, help="also write DIR/checkpoint-N every N steps")
    out.add_argument("--keep", type=int, default=3, help="complete checkpoint-N folders of this run to keep (the "
                                                          "newest always stays)")
    out.add_argument("--save-dtype", choices=["float32", "bfloat16", "float16"],
                     help="the saved weights' dtype (default: the source checkpoint's, else the trained weights')")
    out.add_argument("--max-shard-size", default="5GB", help="shard the safetensors above this size")
    out.add_argument("--resume", help="continue the run whose --save folder this is, from its newest complete "
                                      "checkpoint (verified: every file's size and checksum, one step of one run)")
    out.add_argument("--overwrite", action="store_true",
                     help="let a run without --resume (or resuming an older checkpoint) save into a --save folder "
                          "that holds other checkpoints: they are removed when it starts, with any save a killed "
                          "run left unfinished there (without it the run is refused, so rotation never deletes what "
                          "another run saved)")
    p.add_argument("--world-size", type=int, help="the ranks to run on (default: the --config file's world_size); "
                                                   "launch that many with torchrun --nproc-per-node")
    p.add_argument("--json", action="store_true", help="print a JSON summary instead of text")
    add_knobs(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    tuned = read_yaml(args.config) if args.config else {}
    _ranks_match(_asked_world(args, tuned), args)      # before torch loads: under torchrun, rank 0's line comes first

    from sltune.runtime.memory import DeviceMemoryExceeded
    from sltune.training.loop import TrainJob, find_inputs, run as train

    if isinstance(tuned, dict):     # a best.yaml of disk names no folder: the job gives its own, or trains on host
        tuned = {**tuned, **{f: getattr(args, f) for f in ("optimizer_offload", "param_offload", "offload_dir")
                             if getattr(args, f, None) is not None}}
    base = SpeedLoaderConfig.from_dict(tuned, source=args.config) if args.config else None
    cfg = config_from_args(args, base)
    if args.world_size is not None:
        cfg = cfg.replace(world_size=args.world_size)
    if why := param_offload_refusal(cfg.param_offload, cfg.optimizer_offload, train=True):
        raise ValueError(as_flags(why))
    model_source, model_name = _model(args, tuned)
    job = TrainJob(
        model=model_source, config=cfg, optimizer=_optimizer(args, tuned),
        seq_len=args.seq_len or _tuned_seq_len(tuned) or DEFAULT_SEQ_LEN, steps=args.steps, seed=args.seed,
        data=args.data, tokenizer=args.tokenizer,
        holdout=args.holdout if args.holdout is not None else (DEFAULT_HOLDOUT if args.eval_every else 0.0),
        warmup_steps=args.warmup_steps, lr_schedule=args.lr_schedule, min_lr=args.min_lr,
        max_grad_norm=args.max_grad_norm, eval_every=args.eval_every, log=args.log, save=args.save,
        save_every=args.save_every, keep=args.keep, save_dtype=args.save_dtype, max_shard_size=args.max_shard_size,
        resume=args.resume, overwrite=args.overwrite)
    inputs = find_inputs(job)               # --data, --resume, the tokenizer: a mistake is one line, before the model
    try:
        _fits_device(job, inputs, args)
        rank, world = _join_torchrun(cfg, args)
    except BaseException:
        inputs.release()                    # the --save folder's lock (run() releases it at its end)
        raise
    quiet = args.json or rank != 0
    bar = tqdm(total=job.steps, desc=f"train {model_name} s={job.seq_len} ({_how(cfg)}"
               + (f" x{world} ranks" if world > 1 else "") + ")", unit="step", disable=quiet)

    def progress(line: dict[str, Any]) -> None:
        if bar.n == 0 and line["step"] > 1:
            bar.update(line["step"] - 1)             # resumed: the steps done before
        bar.update(1)
        bar.set_postfix(loss=f"{line['loss']:.4f}", tok_s=f"{line['tokens_per_s']:,.0f}",
                        **({"eval": f"{line['eval_loss']:.4f}"} if "eval_loss" in line else {}))

    try:
        report = train(job, rank, world, progress, inputs)
        close = getattr(report.engine, "close", None)     # a wrapped backend's own process group, when it started one
        if close is not None:
            close()
        # the engine goes now, and its offload_dir folder with it: this frame can outlive the call (optuna, imported
        # by _fits_device, keeps the traceback of its optional redis import, and with it every frame under it)
        report.engine = None
    except DeviceMemoryExceeded as err:
        bar.close()
        if cfg.backend != "speedloader":
            raise ValueError(f"device memory limit exceeded on {cfg.device} by backend {cfg.backend}: the step "
                             f"reached {format_bytes(err.peak_bytes)} against {format_bytes(err.limit_bytes)} "
                             f"({_limit_source(args)}); raise it, or tune again for this limit") from None
        raise ValueError(_over_the_limit(err, job, inputs, args, world)) from None
    finally:
        bar.close()
        if world > 1:
            import torch.distributed as dist

            dist.destroy_process_group()
    if rank != 0:
        return 0
    steps = report.steps
    timed = steps[1:] or steps       # the first step warms up (and measures device memory)
    summary = {
        "model": model_name, "seq_len": job.seq_len, "config": cfg.to_dict(), "optimizer": job.optimizer.to_dict(),
        "steps": len(steps), "first_step": report.first_step, "world_size": world,
        "first_loss": steps[0]["loss"], "final_loss": steps[-1]["loss"],
        "tokens_per_s": sum(s["tokens_per_s"] * s["seconds"] for s in timed) / sum(s["seconds"] for s in timed),
        "wall_seconds": report.wall_seconds, "peak_device_bytes": steps[0]["peak_device_bytes"],
        "io_per_step": steps[-1]["io"].as_dict(), "evals": report.evals, "saved": report.saved,
    }
    if args.json:
        print(json.dumps(summary))
        return 0
    io = steps[-1]["io"]
    ranks = f" on each of {world} ranks" if world > 1 else ""
    resumed = f" (steps {report.first_step}-{job.steps}, resumed)" if report.first_step > 1 else ""
    print(f"trained {len(steps)} steps{resumed} in {report.wall_seconds:.1f}s: loss {summary['first_loss']:.4f} -> "
          f"{summary['final_loss']:.4f}, {summary['tokens_per_s']:,.0f} tokens/s{ranks}")
    if report.evals:
        print(f"held-out loss {report.evals[0]['eval_loss']:.4f} (step {report.evals[0]['step']}) -> "
              f"{report.evals[-1]['eval_loss']:.4f} (step {report.evals[-1]['step']})")
    if cfg.backend != "speedloader":        # its traffic is the wrapper's own, not counted as SpeedLoader's is
        print(f"backend {_how(cfg)}; device peak {format_bytes(summary['peak_device_bytes'])}")
    else:
        _print_io(io, summary)
    if report.saved:
        print(f"saved a Hugging Face folder to {report.saved}: AutoModelForCausalLM.from_pretrained({report.saved!r})"
              + (f"; continue with --resume {report.saved}" if cfg.backend != "deepspeed" else
                 f"; a deepspeed run does not resume, so it keeps no resume state or periodic checkpoints: start "
                 f"another from it with --model {report.saved}"))
    return 0


def _how(cfg: SpeedLoaderConfig) -> str:
    """'speedloader b=2 N=4 k=1', 'fsdp cpu_offload=True reshard_after_forward=True b=2 N=4': what trains."""
    from sltune.backend_knobs import KNOBS

    if cfg.backend == "speedloader":
        return f"{cfg.schedule} b={cfg.sub_batch_size} N={cfg.num_sub_batches} k={cfg.num_live_blocks}"
    knobs = " ".join(f"{k}={getattr(cfg, k)}" for k in KNOBS[cfg.backend])
    return f"{cfg.backend} {knobs} b={cfg.sub_batch_size} N={cfg.num_sub_batches}"


def _print_io(io: Any, summary: dict[str, Any]) -> None:
    print(f"per step: params loaded {format_bytes(io.param_load_bytes)}, grads offloaded "
          f"{format_bytes(io.grad_offload_bytes)}, activations {format_bytes(io.act_offload_bytes)} out / "
          f"{format_bytes(io.act_load_bytes)} in; device peak {format_bytes(summary['peak_device_bytes'])}"
          + (f"; optimizer files {format_bytes(io.disk_read_bytes)} read, {format_bytes(io.disk_write_bytes)} written"
             if io.disk_write_bytes else ""))


def _optimizer(args: argparse.Namespace, tuned: dict[str, Any]) -> OptimizerConfig:
    """The --config file's optimizer section with the flags given on top."""
    section = dict(tuned.get("optimizer") or {})
    section.update({field: getattr(args, flag) for field, flag in OPTIMIZER_FLAGS.items()
                    if getattr(args, flag) is not None})
    try:
        return OptimizerConfig.from_dict(section, source="optimizer")
    except ValueError as err:     # name the flag a user typed, not the section's field
        message = str(err)
        for field, flag in OPTIMIZER_FLAGS.items():
            if getattr(args, flag) is not None:
                message = message.replace(f"optimizer.{field}:", f"--{flag.replace('_', '-')}:")
        raise ValueError(message) from None


def _model(args: argparse.Namespace, tuned: dict[str, Any]) -> tuple[Any, str]:
    """What to build and what to call it: --model, else the model the config was tuned on (a preset, a model
    folder or an inline config.json, as the job's spec gave it), else the default preset."""
    if args.model:
        from sltune.models import PRESETS, load_config

        if args.model not in PRESETS:
            load_config(args.model, source=f"--model {args.model}")     # a mistake is one line, before any work
        return args.model, args.model
    model = (tuned.get("provenance") or {}).get("model") or {}
    if model.get("preset"):
        return model["preset"], model["preset"]
    if model.get("path"):
        return model["path"], model["path"]
    if model.get("hf_config"):
        return model["hf_config"], f"{model['hf_config'].get('model_type', 'model')} (inline config in {args.config})"
    return DEFAULT_MODEL, DEFAULT_MODEL


def _tuned_seq_len(tuned: dict[str, Any]) -> int | None:
    workload = tuned.get("workload") or {}
    return workload.get("seq_len") if workload.get("mode", "train") == "train" else None


def _limit_name(args: argparse.Namespace) -> str:
    """The device memory limit as the user gave it: the flag, or the --config file's field."""
    if args.device_memory_limit is None and args.config:
        return f"device_memory_limit in {args.config}"
    return "--device-memory-limit"


def _override(args: argparse.Namespace) -> str:
    """How to change a limit the --config file set, or nothing when the flag set it."""
    return " (override it with --device-memory-limit)" if _limit_name(args) != "--device-memory-limit" else ""


def _limit_source(args: argparse.Namespace) -> str:
    return f"the limit is {_limit_name(args)}" + ("; override it with --device-memory-limit" if _override(args) else "")


def _fits_device(job: TrainJob, inputs: Inputs, args: argparse.Namespace) -> None:
    """Refuse, before the model is built, a device memory limit below what even the smallest config (b=1 N=1 k=1)
    is predicted to need (sltune.tuning.cost.feasible's refusal, as tune refuses a spec): no knob helps then, so no step
    is run to say so. A limit within PRIOR_MARGIN of that is left to the step, which measures."""
    import os

    from sltune.tuning.cost.feasible import FLAGS, shortfall
    from sltune.tuning.cost.prior import predict

    limit = job.config.device_memory_limit
    if limit is None or job.config.backend != "speedloader":   # the prior models SpeedLoader's memory; a wrapped
        return                                                  # backend's is measured by its first step only
    recipe = _recipe(job, inputs, int(os.environ.get("WORLD_SIZE", "1")))
    least = _smallest(job.config)
    if min(predict(recipe, c).device for c in least) <= limit * (1 + PRIOR_MARGIN):
        return
    short = shortfall(recipe, least, None, limit, device_name=_limit_name(args), naming=FLAGS)
    raise ValueError(f"device memory limit exceeded by every config, predicted before any step: {short}"
                     f"{_override(args)}")


def _over_the_limit(err: DeviceMemoryExceeded, job: TrainJob, inputs: Inputs, args: argparse.Namespace,
                    world: int) -> str:
    """The step's refusal with the fix the prior gives: the knobs whose config is predicted within the limit,
    keeping the batch (sub-batches of fewer rows, fewer live layers, recompute), else the limit it takes."""
    from sltune.tuning.cost.prior import predict

    cfg, this = job.config, _candidate(job.config)
    recipe = _recipe(job, inputs, world)
    needs = {c: predict(recipe, c).device for c in _lower_configs(cfg)}
    fitting = [c for c, need in needs.items() if c != this and need <= err.limit_bytes]
    if fitting:
        best = max(fitting, key=lambda c: (c.sub_batch_size, c.num_live_blocks, c.activations == cfg.activations))
        fix = f"{best} is predicted to need {format_bytes(needs[best])}: pass {_flags(best, cfg)}"
    else:
        least, need = min(needs.items(), key=lambda cn: (cn[1], cn[0]))
        fix = (f"no other config of {cfg.effective_batch_size} rows a step is predicted within it (the least, {least},"
               f" is predicted to need {format_bytes(need)}); raise it to at least "
               f"{format_bytes(max(need, err.peak_bytes))}")
    return (f"device memory limit exceeded on {cfg.device}: the step reached {format_bytes(err.peak_bytes)} "
            f"({err.peak_bytes} bytes) against a limit of {format_bytes(err.limit_bytes)} ({err.limit_bytes} "
            f"bytes). {fix} ({_limit_source(args)})")


def _recipe(job: TrainJob, inputs: Inputs, world: int) -> Setup:
    """What the prior predicts this job from: the model (the resumed checkpoint's when resuming), how it steps,
    its optimizer, seq_len and ranks."""
    from sltune.tuning.cost.setup import Setup
    from sltune.tuning.cost.shape import shape_of

    cfg = job.config
    model = str(inputs.source) if inputs.source is not None else job.model
    return Setup(model, shape_of(model, cfg.dtype), "train", cfg.schedule, cfg.mixed_precision, job.optimizer,
                  world, cfg.device, job.seq_len, optimizer_offload=cfg.optimizer_offload,
                  param_offload=cfg.param_offload, clips=job.max_grad_norm is not None)


def _candidate(cfg: SpeedLoaderConfig) -> Candidate:
    from sltune.tuning.space import Candidate

    return Candidate(cfg.sub_batch_size, cfg.num_sub_batches, cfg.num_live_blocks, cfg.activations,
                     optimizer_offload=cfg.optimizer_offload, param_offload=cfg.param_offload)


def _smallest(cfg: SpeedLoaderConfig) -> list[Candidate]:
    """The configs any device limit is met by first: one row, one sub-batch, one live layer; this activations
    setting or recompute."""
    import dataclasses

    one = dataclasses.replace(_candidate(cfg), sub_batch_size=1, num_sub_batches=1, num_live_blocks=1)
    return [one] + ([dataclasses.replace(one, activations="recompute")] if one.activations != "recompute" else [])


def _lower_configs(cfg: SpeedLoaderConfig) -> list[Candidate]:
    """This config and those of its batch with fewer rows per sub-batch (more sub-batches), fewer live layers (its
    count halved down to 1) or recompute instead of offload: each needs no more device memory."""
    import dataclasses

    batch, k, ks = cfg.effective_batch_size, cfg.num_live_blocks, []
    while k >= 1:
        ks.append(k)
        k //= 2
    return [dataclasses.replace(_candidate(cfg), sub_batch_size=b, num_sub_batches=batch // b,
                                num_live_blocks=k, activations=a)
            for b in range(1, cfg.sub_batch_size + 1) if batch % b == 0 for k in ks
            for a in sorted({cfg.activations, "recompute"})]


def _flags(c: Candidate, cfg: SpeedLoaderConfig) -> str:
    """The flags that turn cfg into c: '--sub-batch-size 1 --num-sub-batches 4 --num-live-blocks 1'."""
    flags = []
    if c.sub_batch_size != cfg.sub_batch_size:
        flags.append(f"--sub-batch-size {c.sub_batch_size} --num-sub-batches {c.num_sub_batches} (the same "
                     f"{c.batch} rows a step)")
    if c.num_live_blocks != cfg.num_live_blocks:
        flags.append(f"--num-live-blocks {c.num_live_blocks}")
    if c.activations != cfg.activations:
        flags.append(f"--activations {c.activations}")
    return " ".join(flags)


def _asked_world(args: argparse.Namespace, tuned: Any) -> int | None:
    """The ranks the run is meant for: --world-size, else the --config file's world_size (a value there that is no
    whole number is left to the config's own check, which names it)."""
    if args.world_size is not None:
        if args.world_size < 1:
            raise ValueError(f"--world-size must be >= 1, got {args.world_size}")
        return args.world_size
    asked = tuned.get("world_size") if isinstance(tuned, dict) else None
    return asked if isinstance(asked, int) and not isinstance(asked, bool) else None


def _ranks_match(asked: int | None, args: argparse.Namespace) -> None:
    """Refuse a world size other than the ranks running (WORLD_SIZE, which torchrun sets). Under torchrun rank 0
    says so in one line and every other rank leaves silently with the same code: the line is said once, first,
    not buried in torchrun's report of each rank's failure."""
    import os

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if asked is None or asked == world:
        return
    if int(os.environ.get("RANK", "0")) != 0:
        _leave_quietly(2)
    where = f"{args.config} was tuned for" if args.config and args.world_size is None else "--world-size is"
    raise ValueError(f"{where} world_size {asked} but {world} rank{'s' if world > 1 else ''} "
                     f"{'are' if world > 1 else 'is'} running; pass --world-size {world}, or launch "
                     f"{asked} with torchrun --nproc-per-node {asked}")


def _leave_quietly(code: int) -> NoReturn:
    """Exit with `code`, saying nothing, once rank 0 has said why: torchrun stops the other ranks when one fails
    (SIGTERM, taken here as this exit), and RANK0_GRACE_S bounds the wait should rank 0 never fail (a rank 0
    on another node that is not told)."""
    import os
    import signal
    import time

    signal.signal(signal.SIGTERM, lambda *_: os._exit(code))
    time.sleep(RANK0_GRACE_S)
    raise SystemExit(code)


def _join_torchrun(cfg: SpeedLoaderConfig, args: argparse.Namespace) -> tuple[int, int]:
    """Under torchrun (WORLD_SIZE > 1 in the environment) join the process group: the engine then shards
    parameters over the ranks, each of which trains on its own rows."""
    import os

    world = int(os.environ.get("WORLD_SIZE", "1"))
    _ranks_match(cfg.world_size, args)     # the config's world_size, as it validated it
    if world <= 1:
        return 0, 1
    import torch
    import torch.distributed as dist

    # before the group exists, never after: sltune.runtime.sharding's first comment says why (SIGABRT at exit)
    import sltune.runtime.sharding  # noqa: F401

    backend = "nccl" if cfg.device.startswith("cuda") else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend)
    return dist.get_rank(), world
