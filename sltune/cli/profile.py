"""`sltune profile`: one isolated trial; prints a TrialResult (as JSON with --json)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from sltune.cli.common import DISK_VERSIONS_ALONE, as_flags
from sltune.config import param_offload_refusal
from sltune.field_errors import one_line
from sltune.profiling import forks, run_trial
from sltune.profiling.schema import TrialSpec
from sltune.sizes import format_bytes
from sltune.training.optimizer import OptimizerConfig


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("profile", help="run one isolated, profiled trial",
                       description="Run one config in its own process: throughput, measured peaks and a time "
                                   "breakdown, and its step-1 loss against plain PyTorch's (parity). Exit code 0 "
                                   "when the trial is ok, 3 when it is oom/failed/timeout/diverged.")
    p.add_argument("--model", default="llama-tiny",
                   help="preset name, a Hugging Face model folder (its weights are loaded: model.safetensors or the "
                        "shards its index lists; a folder with only config.json gets random weights) or a "
                        "transformers config.json")
    p.add_argument("--backend", default="speedloader", choices=("speedloader", "deepspeed", "fsdp"),
                   help="what trains: SpeedLoader's engine, DeepSpeed ZeRO (deepspeed.initialize; bash "
                        "scripts/install.sh backends) or PyTorch FSDP2 (fully_shard per decoder layer)")
    p.add_argument("--zero-stage", type=int, choices=(2, 3), help="deepspeed: ZeRO stage (default 2)")
    p.add_argument("--offload-optimizer", choices=("none", "cpu", "nvme"),
                   help="deepspeed: the optimizer's state on the device, in host memory or on NVMe under "
                        "--offload-dir (default none)")
    p.add_argument("--offload-param", choices=("none", "cpu", "nvme"),
                   help="deepspeed, --zero-stage 3: the parameter partitions on the device, in host memory or on "
                        "NVMe under --offload-dir (default none)")
    p.add_argument("--cpu-offload", action="store_const", const=True,
                   help="fsdp: CPUOffloadPolicy, the sharded parameters, gradients and optimizer state in host memory")
    p.add_argument("--reshard-after-forward", action=argparse.BooleanOptionalAction,
                   help="fsdp: free each layer's gathered parameters after its forward (default: yes)")
    p.add_argument("--sub-batch-size", type=int, default=1, help="rows per sub-batch (b)")
    p.add_argument("--num-sub-batches", type=int, default=1, help="sub-batches per step (N)")
    p.add_argument("--num-live-blocks", type=int, default=1, help="speedloader: layers live on the device at once (k)")
    p.add_argument("--schedule", default="speedloader", help="speedloader: speedloader | canonical | resident")
    p.add_argument("--activations", default="recompute", choices=["recompute", "offload"],
                   help="recompute | offload: rerun each group's forward in backward, or keep autograd's saved "
                        "tensors in host memory")
    p.add_argument("--mode", default="train", help="train | generate")
    p.add_argument("--kv-cache", default="host", choices=("host", "device"), help="generate: where KV caches live")
    p.add_argument("--weights-on-device", type=float, default=0.0, metavar="SHARE",
                   help="generate only: the share of the parameter bytes kept on the device for the whole call, "
                        "0 to 1 (whole units: tied weights, embedding, head, then groups); the rest is copied in "
                        "at every step")
    p.add_argument("--seq-len", type=int, default=128, help="train: tokens per row")
    p.add_argument("--prompt-len", type=int, default=32, help="generate: prompt tokens")
    p.add_argument("--new-tokens", type=int, default=16, help="generate: tokens to generate")
    p.add_argument("--steps", type=int, default=2, help="timed steps at least (after one warm-up step)")
    p.add_argument("--min-time", type=float, default=2.0,
                   help="time steps until they add up to this many seconds")
    p.add_argument("--max-steps", type=int, default=100, help="timed steps at most while calibrating")
    p.add_argument("--cpu-threads", type=int, help="torch intra-op threads for the trial (default: all cores)")
    p.add_argument("--world-size", type=int, default=1, help="ranks the trial launches (gloo on the CPU); at most "
                                                             "this machine's cores unless --oversubscribe")
    p.add_argument("--oversubscribe", action="store_true",
                   help="launch --world-size ranks even beyond this machine's cores (refused otherwise: the ranks "
                        "would take turns on the cores, and the trial would measure that)")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    p.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16")
    p.add_argument("--no-mixed-precision", dest="mixed_precision", action="store_const", const=False,
                   help="with --dtype bfloat16/float16, keep one copy of the weights and the optimizer state in that "
                        "dtype instead of float32 masters (default: mixed precision)")
    p.add_argument("--optimizer", default="adamw", choices=("adamw", "sgd"),
                   help="what the host parameters are stepped with, as the training job will (default: adamw)")
    p.add_argument("--lr", type=float, help="learning rate (default: OptimizerConfig's, 1e-3)")
    p.add_argument("--weight-decay", type=float, help="weight decay (default: torch's, 0.01 for AdamW, 0 for SGD)")
    p.add_argument("--momentum", type=float, help="SGD's momentum (default: 0, which keeps no state)")
    p.add_argument("--optimizer-offload", default="host", choices=("host", "disk"),
                   help="train: where the float32 masters and the optimizer state live: host memory, or files under "
                        "--offload-dir stepped unit by unit through a bounded window")
    p.add_argument("--param-offload", default="host", choices=("host", "disk"),
                   help="host | disk: the dtype copy of the weights in host memory, or a file per unit under "
                        "--offload-dir read ahead into a bounded window (training: with --optimizer-offload disk)")
    p.add_argument("--offload-dir", help="the directory of --optimizer-offload/--param-offload disk's files, on a "
                   "local disk")
    p.add_argument("--disk-versions", type=int, default=2, choices=(1, 2),
                   help="--optimizer-offload disk: versions of the files a step keeps; 1 drops each old file as its "
                        "new one lands (about half the disk)")
    p.add_argument("--device-memory-limit", help="bytes or e.g. 2GiB (default: no limit)")
    p.add_argument("--host-memory-limit", help="stop the trial as oom above this resident memory (default: no "
                                               "limit)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds before the trial is stopped")
    p.add_argument("--trace", help="write the profiled step as a Chrome/Perfetto trace (JSON)")
    p.add_argument("--no-profile", action="store_true", help="skip the profiled step (no breakdown)")
    p.add_argument("--json", action="store_true", help="print the TrialResult as JSON")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if not 0 <= args.weights_on_device <= 1:
        raise ValueError(f"--weights-on-device {args.weights_on_device:g}: give a share from 0 (no weights kept on "
                         "the device) to 1 (all of them)")
    spec = _spec(model=_model(args.model), optimizer=_optimizer(args),
                 mixed_precision=args.mixed_precision is not False,
                 sub_batch_size=args.sub_batch_size, num_sub_batches=args.num_sub_batches,
                 num_live_blocks=args.num_live_blocks, schedule=args.schedule,
                 activations=args.activations, mode=args.mode, kv_cache=args.kv_cache,
                 weights_on_device=args.weights_on_device,
                 seq_len=args.seq_len, prompt_len=args.prompt_len, new_tokens=args.new_tokens,
                 steps=args.steps, min_time_s=args.min_time, max_steps=args.max_steps,
                 cpu_threads=args.cpu_threads, world_size=args.world_size, device=args.device, dtype=args.dtype,
                 device_memory_limit=args.device_memory_limit, host_memory_limit=args.host_memory_limit,
                 timeout_s=args.timeout, trace_path=args.trace, profile=not args.no_profile,
                 optimizer_offload=args.optimizer_offload, param_offload=args.param_offload,
                 offload_dir=_offload_dir(args), disk_versions=args.disk_versions,
                 backend=args.backend, zero_stage=args.zero_stage, offload_optimizer=args.offload_optimizer,
                 offload_param=args.offload_param, cpu_offload=args.cpu_offload,
                 reshard_after_forward=args.reshard_after_forward)
    if not args.oversubscribe:
        from sltune.settings import Settings
        from sltune.tuning.search.trials import ranks_fit

        ranks_fit(spec.world_size, Settings().world_size_ceiling, "--world-size", "--oversubscribe")
    # the trial's fork server imports torch and transformers on the other core while this process checks the spec
    # against the host (the prior imports them too): one after the other they were 5 of an idle machine's 14 s
    forks.start()
    if spec.backend == "speedloader":   # the prior models SpeedLoader's memory; another backend's is measured only
        _fits_host(spec)
    result = run_trial(spec)
    if args.json:
        print(result.model_dump_json())
    else:
        print(describe(result))
    return 0 if result.status == "ok" else 3


# the spec's fields a refusal names, as this command's flags
FLAGS = {name: "--" + name.replace("_", "-") for name in
         ("zero_stage", "offload_optimizer", "offload_param", "cpu_offload", "reshard_after_forward",
          "offload_dir", "num_live_blocks", "schedule", "optimizer_offload", "param_offload", "disk_versions", "mode",
          "dtype", "world_size")}
FLAGS["mixed_precision"] = "--no-mixed-precision"


def _spec(**fields: Any) -> TrialSpec:
    """The trial spec; a refusal (a knob of another backend, offload_param without stage 3, ...) names the flags."""
    try:
        return TrialSpec(**fields)
    except ValidationError as err:
        raise ValueError(as_flags(one_line(err), FLAGS)) from None


def _fits_host(spec: TrialSpec) -> None:
    """What the trial would hold, predicted from the model's shape (sltune.tuning.cost.prior): refused before anything
    is built when over --host-memory-limit (else this machine's trial ceiling; all ranks together, as the trial
    is held to it) or --device-memory-limit."""
    from sltune.settings import Settings
    from sltune.tuning.cost.baseline import trial_baseline
    from sltune.tuning.cost.feasible import FLAGS, shortfall
    from sltune.tuning.cost.prior import Setup
    from sltune.tuning.cost.shape import shape_of
    from sltune.tuning.space import Candidate

    settings = Settings()
    shape = shape_of(spec.model, spec.dtype)
    config = Candidate.from_knobs(spec.knobs())
    recipe = Setup.of_trial(spec, shape, trial_baseline(spec.device, spec.world_size, spec.mode, spec.cpu_threads))
    where = "--host-memory-limit" if spec.host_memory_limit else settings.trial_host_limit_source()
    short = shortfall(recipe, [config], spec.host_memory_limit or settings.trial_host_limit(),
                      spec.device_memory_limit, host_name=where, device_name="--device-memory-limit",
                      what="this trial", naming=FLAGS)
    if short:
        raise ValueError(f"this trial cannot fit: {short}")


def _offload_dir(args: argparse.Namespace) -> str | None:
    """--offload-dir, checked writable here (a mistake is one line, not a failed trial), and only with disk (or
    DeepSpeed's nvme offload)."""
    from sltune.runtime.direct_io import writable_dir

    if args.disk_versions != 2 and (args.optimizer_offload != "disk" or args.backend != "speedloader"):
        raise ValueError(DISK_VERSIONS_ALONE)
    if args.backend == "deepspeed":         # nvme offload's folder; the spec refuses it without nvme
        return str(writable_dir(args.offload_dir, "--offload-dir")) if args.offload_dir else None
    if why := param_offload_refusal(args.param_offload, args.optimizer_offload, args.mode == "train"):
        raise ValueError(as_flags(why, FLAGS))
    if args.optimizer_offload == "host" and args.param_offload == "host":
        if args.offload_dir:
            raise ValueError("--offload-dir: the optimizer's files go there under --optimizer-offload disk (the "
                             "weights' under --param-offload disk); add --optimizer-offload disk (or drop "
                             "--offload-dir)")
        return None
    if args.schedule == "resident" and args.param_offload == "disk":
        raise ValueError("--param-offload disk: the resident schedule keeps every weight on the device; use "
                         "--param-offload host, or --schedule speedloader or canonical")
    if args.schedule == "resident" and args.mode == "train":      # SpeedLoaderConfig's check, named by its flags
        raise ValueError("--optimizer-offload disk: the resident schedule steps its optimizer on the device; use "
                         "--optimizer-offload host, or --schedule speedloader or canonical")
    if not args.offload_dir:
        which = "--optimizer-offload disk keeps the optimizer's" if args.optimizer_offload == "disk" \
            else "--param-offload disk keeps the weights'"
        raise ValueError(f"--offload-dir: {which} files there; give a directory on a local disk")
    return str(writable_dir(args.offload_dir, "--offload-dir"))


def _model(model: str) -> str:
    """A preset's name as it is; a folder or config.json as an absolute path, once its config.json is one sltune
    accepts (a mistake is one line here, not a failed trial)."""
    from sltune.models import PRESETS, load_config

    if model in PRESETS:
        return model
    load_config(model, source=f"--model {model}")
    return str(Path(model).resolve())


def _optimizer(args: argparse.Namespace) -> OptimizerConfig:
    """--optimizer and its hyperparameters; a bad value names its flag."""
    if args.momentum is not None and args.optimizer != "sgd":
        raise ValueError(f"--momentum is SGD's; add --optimizer sgd, or drop --momentum ({args.optimizer} has none)")
    given = {"name": args.optimizer, "lr": args.lr, "weight_decay": args.weight_decay, "momentum": args.momentum}
    try:
        return OptimizerConfig(**{k: v for k, v in given.items() if v is not None})
    except ValidationError as err:
        raise ValueError(one_line(err, name=lambda field: f"--{field.replace('_', '-')} {given.get(field)}")) from None


def describe(r) -> str:
    c = r.config
    if c.backend == "speedloader":
        what = f"{c.schedule} ({c.activations}) b={c.sub_batch_size} N={c.num_sub_batches} k={c.num_live_blocks}"
    else:
        knobs = " ".join(f"{k}={v}" for k, v in c.model_dump().items()
                         if k in ("zero_stage", "offload_optimizer", "offload_param", "cpu_offload",
                                  "reshard_after_forward"))
        what = f"{c.backend} {knobs} ({c.activations}) b={c.sub_batch_size} N={c.num_sub_batches}"
    lines = [f"trial {r.status}: {what} s={c.seq_len} W={c.world_size}"
             + (f" kv_cache={c.kv_cache}" if c.kv_cache else "")
             + (f" weights_on_device={c.weights_on_device:g}" if c.weights_on_device is not None else "")]
    if r.error:
        lines.append(f"  {r.error}")
    if r.parity is not None:
        p = r.parity
        lines.append(f"  parity {'ok' if p.ok else 'OFF'}: step-1 loss {p.loss:.6g} against plain PyTorch's "
                     f"{p.reference_loss:.6g}, relative difference {p.rel_diff:.2g} (tolerance {p.tolerance:.2g})")
    if r.backend_detail:
        lines.append("  " + ", ".join(f"{k}: {v}" for k, v in r.backend_detail.items()))
    if r.tokens_per_s is not None:
        lines.append(f"  {r.tokens_per_s:,.1f} tokens/s, {r.step_seconds:.3f} s/step (medians)")
    if r.timing is not None:
        t = r.timing
        lo, hi = t.tokens_per_s_ci95
        cv = f"{t.cv:.1%}" if t.cv is not None else "-"
        lines.append(f"  95% interval {lo:,.1f} .. {hi:,.1f} tokens/s over {len(t.steps_s)} steps, cv {cv}; "
                     f"other processes used {t.interference.others_busy_cores:.1f} of {t.interference.cores} cores")
        if t.unstable:
            lines.append(f"  UNSTABLE after {t.rounds} rounds: {'; '.join(t.unstable_reasons)}")
    lines.append(f"  peak device {format_bytes(r.peak_device_bytes)}, peak host {format_bytes(r.peak_host_bytes)}")
    if r.breakdown is not None:
        parts = ", ".join(f"{k} {v:.1%}" for k, v in r.breakdown.model_dump().items())
        lines.append(f"  time: {parts}")
    if r.trace_path:
        lines.append(f"  trace: {r.trace_path} (open in https://ui.perfetto.dev)")
    return "\n".join(lines)
