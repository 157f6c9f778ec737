"""`sltune profile`: one isolated trial; prints a TrialResult (as JSON with --json)."""

from __future__ import annotations

import argparse
import socket
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from sltune.backend_knobs import BackendKnobs
from sltune.cli.common import unused_flags
from sltune.cli.flags import add_fields, given, reword
from sltune.config import RuntimeKnobs
from sltune.field_errors import one_line
from sltune.executors import EXECUTORS, executor_for
from sltune.profiling import forks
from sltune.profiling.schema import TrialSpec
from sltune.settings import Settings
from sltune.sizes import format_bytes
from sltune.training.optimizer import OptimizerConfig

# TrialSpec's fields `profile` takes as flags, each declared once: the backend and its knobs (sltune.backend_knobs),
# the runtime's knobs (sltune.config.RuntimeKnobs), then what the trial runs and for how long
KNOBS = (*BackendKnobs.model_fields, *RuntimeKnobs.model_fields, "mode", "seq_len", "prompt_len", "new_tokens", "steps",
         "max_steps", "cpu_threads", "host_memory_limit", "nodes")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("profile", help="run one isolated, profiled trial",
                       description="Run one config in its own process: throughput, measured peaks and a time "
                                   "breakdown, and its step-1 loss against plain PyTorch's (parity). Exit code 0 "
                                   "when the trial is ok, 3 when it is oom/failed/timeout/diverged.")
    p.add_argument("--model", default="llama-tiny",
                   help="preset name, a Hugging Face model folder (its weights are loaded: model.safetensors or the "
                        "shards its index lists; a folder with only config.json gets random weights) or a "
                        "transformers config.json")
    add_fields(p, TrialSpec, KNOBS, notes={"world_size": "; at most this machine's cores unless --oversubscribe"})
    p.add_argument("--oversubscribe", action="store_true",
                   help="launch --world-size ranks even beyond this machine's cores (refused otherwise: the ranks "
                        "would take turns on the cores, and the trial would measure that)")
    p.add_argument("--min-time", type=float, default=2.0,
                   help="time steps until they add up to this many seconds")
    p.add_argument("--optimizer", default="adamw", choices=("adamw", "sgd"),
                   help="what the host parameters are stepped with, as the training job will (default: adamw)")
    p.add_argument("--lr", type=float, help="learning rate (default: OptimizerConfig's, 1e-3)")
    p.add_argument("--weight-decay", type=float, help="weight decay (default: torch's, 0.01 for AdamW, 0 for SGD)")
    p.add_argument("--momentum", type=float, help="SGD's momentum (default: 0, which keeps no state)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds before the trial is stopped")
    p.add_argument("--trace", help="write the profiled step as a Chrome/Perfetto trace (JSON)")
    p.add_argument("--no-profile", action="store_true", help="skip the profiled step (no breakdown)")
    p.add_argument("--json", action="store_true", help="print the TrialResult as JSON")
    p.add_argument("--executor", choices=EXECUTORS, default="local",
                   help="where the trial runs: this machine, or the nodes of the Ray cluster at SLTUNE_RAY_ADDRESS "
                        "(or RAY_ADDRESS; pip install -e '.[ray]')")
    p.add_argument("--ranks-per-node", type=int, metavar="R",
                   help="ranks on each of --nodes nodes (--executor ray): --world-size is nodes x R")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    knobs = given(args, KNOBS)
    unused_flags(knobs, knobs)
    if args.ranks_per_node is not None:
        world = knobs.get("nodes", 1) * args.ranks_per_node
        if knobs.get("world_size", world) != world:
            raise ValueError(f"--world-size {knobs['world_size']} is not --nodes x --ranks-per-node = {world}; give "
                             "two of the three")
        knobs["world_size"] = world
    if "nodes" in knobs:
        knobs.setdefault("world_size", knobs["nodes"])          # a rank on each
    if knobs.get("nodes", 1) > 1 and args.executor != "ray":
        raise ValueError(f"--nodes {knobs['nodes']} needs a cluster: add --executor ray (this machine is one node)")
    spec = _spec(model=_model(args.model), optimizer=_optimizer(args), min_time_s=args.min_time,
                 timeout_s=args.timeout, trace_path=args.trace, profile=not args.no_profile, **knobs)
    if spec.offload_dir:
        from sltune.runtime.disk.direct_io import writable_dir

        spec = spec.model_copy(update={"offload_dir": str(writable_dir(spec.offload_dir, "--offload-dir"))})
    if args.executor == "ray":      # the trial runs on a node of the cluster: neither this machine's cores nor its
        executor = executor_for("ray", Settings().ray_address)     # memory bound it
    else:
        if not args.oversubscribe:
            from sltune.tuning.search.trials import ranks_fit

            ranks_fit(spec.world_size, Settings().world_size_ceiling, "--world-size", "--oversubscribe")
        # the trial's fork server imports torch and transformers on the other core while this process checks the
        # spec against the host (the prior imports them too): one after the other they were 5 of an idle machine's
        # 14 s
        forks.start()
        if spec.backend == "speedloader":   # the prior models SpeedLoader's memory; another backend's is measured
            _fits_host(spec)
        executor = executor_for("local")
    try:
        result = executor.run(spec)
    finally:
        executor.close()
    if args.json:
        print(result.model_dump_json())
    else:
        print(describe(result))
    return 0 if result.status == "ok" else 3


def _spec(**fields: Any) -> TrialSpec:
    """The trial spec; a refusal (a knob of another backend, offload_param without stage 3, ...) names the flags."""
    try:
        return TrialSpec(**fields)
    except ValidationError as err:
        raise ValueError(reword(one_line(err), TrialSpec, KNOBS)) from None


def _fits_host(spec: TrialSpec) -> None:
    """What the trial would hold, predicted from the model's shape (sltune.tuning.cost.prior): refused before anything
    is built when over --host-memory-limit (else this machine's trial ceiling; all ranks together, as the trial
    is held to it) or --device-memory-limit."""
    from sltune.tuning.cost.baseline import trial_baseline
    from sltune.tuning.cost.feasible import FLAGS, shortfall
    from sltune.tuning.cost.setup import Setup
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
    if r.nodes and set(r.nodes) != {socket.gethostname()}:
        lines.append(f"  ran on {', '.join(dict.fromkeys(r.nodes))}")
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
