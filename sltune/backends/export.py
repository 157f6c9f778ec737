"""A tuned pick in its own backend's format: DeepSpeed's JSON config for a deepspeed pick, accelerate's config
YAML (FSDP2) for an fsdp pick. best.yaml, which every pick has, is sltune.tuning.report.result.export_yaml's.

    entry = pick(result, "deepspeed")                 # a job result's pick of that backend (None: the overall best)
    check_format("ds_config", backend_of(entry))      # a format of another backend is refused, naming the fix
    deepspeed_config(entry["config"], dtype=..., optimizer=spec.optimizer.to_dict(), hidden_size=...)

The trial's own DeepSpeed config (ds_config) is built here too, so what a trial measured and what is exported are
one config. No torch: the model facts a format needs (hidden size, decoder layer class) come from model_facts,
which loads transformers only when called.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import yaml

from sltune.backend_knobs import BACKENDS, DEFAULTS

if TYPE_CHECKING:
    from sltune.backends.base import TrainingSpec

FORMATS: tuple[str, ...] = ("yaml", "ds_config", "accelerate")
MEDIA_TYPES = {"yaml": "application/yaml", "ds_config": "application/json", "accelerate": "application/yaml"}
OWN_FORMAT = {"deepspeed": "ds_config", "fsdp": "accelerate"}     # what each wrapped backend's own launcher reads
FORMAT_NAME = {"ds_config": "DeepSpeed's JSON config", "accelerate": "accelerate's FSDP2 config",
               "yaml": "best.yaml"}
NO_CLIPPING = 0.0       # DeepSpeed clips to norm 1.0 unless told; SpeedLoader, the reference and `sltune train` do not
# An nvme pick's swap folder: the trial's was the tuning machine's and is gone; DeepSpeed's documented example
# stands in for the training machine's local NVMe mount (edit it)
NVME_PATH = "/local_nvme"


class FormatMismatch(ValueError):
    """A format another backend reads, asked of this pick (the API answers 422 on the format parameter)."""


class NoPick(ValueError):
    """A backend the job has no pick of (the API answers 404)."""


# -- which pick ---------------------------------------------------------------------------------------------------
def backend_of(entry: Mapping[str, Any]) -> str:
    """The backend a result entry (best, or one of best_by_backend) trained with; results from before backends are
    SpeedLoader's."""
    return (entry.get("config") or {}).get("backend") or "speedloader"


def picked(result: Mapping[str, Any]) -> list[str]:
    """The backends a job result has a pick of: best_by_backend's, and the overall best's."""
    best = result.get("best")
    return sorted({*(b for b, e in (result.get("best_by_backend") or {}).items() if e),
                   *([backend_of(best)] if best else [])})


def pick(result: Mapping[str, Any], backend: str | None = None, flag: str = "--backend") -> dict[str, Any]:
    """The job result's pick for `backend` (its best_by_backend entry), or the overall best for None. A backend the
    job has no pick of is refused naming the ones it has."""
    best = result.get("best")
    if not best:
        raise ValueError(f"job {result.get('job_id')} has no best config (no trial ran successfully)")
    if backend is None:
        return dict(best)
    if backend not in BACKENDS:
        raise ValueError(f"{flag} {backend!r}: choose one of {', '.join(BACKENDS)}")
    by_backend = result.get("best_by_backend") or {}
    if by_backend.get(backend):
        return dict(by_backend[backend])
    if backend_of(best) == backend:
        return dict(best)
    have = picked(result)
    raise NoPick(f"{flag} {backend}: job {result.get('job_id')} has no {backend} pick (its spec did not search "
                      f"it, or none of its {backend} trials succeeded); it has {', '.join(have)}: pass {flag} "
                      f"{' or '.join(have)}")


def check_format(fmt: str, backend: str, flags: tuple[str, str] = ("--backend", "--format"),
                 have: list[str] | None = None) -> None:
    """yaml fits every pick; ds_config a deepspeed pick and accelerate an fsdp pick only: another is refused in one
    line naming the format that fits, and the backend whose pick has the asked format where the job has one
    (`have`: the backends it has a pick of; None: not known, so named)."""
    backend_flag, format_flag = flags
    if fmt not in FORMATS:
        raise ValueError(f"{format_flag} {fmt!r}: choose one of {', '.join(FORMATS)}")
    own = OWN_FORMAT.get(backend)
    if fmt == "yaml" or fmt == own:
        return
    meant_for = next(b for b, f in OWN_FORMAT.items() if f == fmt)
    fits = f"{format_flag} {own} ({FORMAT_NAME[own]}) or yaml" if own else \
        f"{format_flag} yaml (what `sltune train --config` reads)"
    other = (f", or {backend_flag} {meant_for} for the job's {meant_for} pick" if have is None or meant_for in have
             else f"; the job has no {meant_for} pick (its picks: {', '.join(have)})")
    raise FormatMismatch(f"{format_flag} {fmt} is {FORMAT_NAME[fmt]}, for {_a(meant_for)} {meant_for} pick, and this "
                         f"pick is {backend}: use {fits}{other}")


def _a(word: str) -> str:
    return "an" if word.startswith(("a", "e", "f", "i", "o", "s", "u")) else "a"     # "an fsdp", "a deepspeed"


# -- what the formats need to know of the model -------------------------------------------------------------------
@dataclass(frozen=True)
class ModelFacts:
    hidden_size: int                    # DeepSpeed's bucket sizes scale with it
    layer_classes: tuple[str, ...]      # the decoder layer classes FSDP wraps: transformers' _no_split_modules


def model_facts(model: Any) -> ModelFacts:
    """The facts of a model source (a preset, an inline config.json, a config file or a model folder), from its
    config and its transformers class; no weights are read."""
    from transformers import AutoModelForCausalLM

    from sltune.models import load_config

    config = load_config(model)
    cls = AutoModelForCausalLM._model_mapping[type(config)]
    layers = tuple(getattr(cls, "_no_split_modules", None) or ())
    if not layers:
        raise ValueError(f"{cls.__name__} names no decoder layer class (_no_split_modules) to wrap; FSDP's auto-wrap "
                         "needs one")
    return ModelFacts(hidden_size=int(config.hidden_size), layer_classes=layers)


# -- DeepSpeed ----------------------------------------------------------------------------------------------------
def reduce_bucket(hidden: int) -> int:
    """DeepSpeed's reduce bucket in values, what transformers' integration fills in for "auto" (the wrapped prior
    counts the gradients larger than it, which ZeRO-2 copies: sltune.tuning.cost.wrapped)."""
    return hidden * hidden


def ds_config(spec: TrainingSpec | Any, world: int, hidden: int) -> dict[str, Any]:
    """The DeepSpeed config for the spec's knobs, as a trial runs it (deepspeed_config adds what an exported file
    needs). Bucket sizes are what transformers' DeepSpeed integration fills in for "auto", from the hidden size:
    DeepSpeed's own defaults (5e8 elements) would allocate gigabytes for any model. A spec with `max_grad_norm` (a
    training job's) clips to it."""
    stage = spec.zero_stage or 2
    zero: dict[str, Any] = {"stage": stage, "reduce_bucket_size": reduce_bucket(hidden)}
    if stage == 3:
        zero.update(stage3_prefetch_bucket_size=int(0.9 * hidden * hidden),
                    stage3_param_persistence_threshold=10 * hidden)
    for knob in ("offload_optimizer", "offload_param"):
        target = getattr(spec, knob) or "none"
        if target != "none":
            zero[knob] = {"device": target, **({"nvme_path": spec.offload_dir} if target == "nvme" else {})}
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": spec.sub_batch_size,
        "gradient_accumulation_steps": spec.num_sub_batches,
        "train_batch_size": spec.sub_batch_size * spec.num_sub_batches * world,
        "zero_optimization": zero,
        "gradient_clipping": getattr(spec, "max_grad_norm", None) or NO_CLIPPING,
        "zero_force_ds_cpu_optimizer": False,       # the spec's optimizer may be torch's (SGD, or no CPU Adam op)
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }
    if spec.dtype == "bfloat16":
        config["bf16"] = {"enabled": True}
    elif spec.dtype == "float16":
        config["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 16}
    return config


def deepspeed_config(knobs: Mapping[str, Any], *, dtype: str, optimizer: Mapping[str, Any],
                     hidden_size: int) -> dict[str, Any]:
    """The file `deepspeed.initialize(model=..., model_parameters=..., config=FILE)` trains with as it is: the pick's
    ZeRO stage and offload, its micro-batch (b) and accumulation (N), the precision of the spec's dtype, the spec's
    optimizer as the trial stepped it (torch's AdamW on the device; DeepSpeed's CPU Adam where the optimizer is
    offloaded), and `sltune train`'s defaults: a constant learning rate, no warmup, no clipping. The batch is left
    to DeepSpeed (b*N times the ranks it runs on), so the file fits any world size."""
    spec = SimpleNamespace(**{k: knobs.get(k, DEFAULTS[k]) for k in ("zero_stage", "offload_optimizer",
                                                                     "offload_param")},
                           offload_dir=knobs.get("offload_dir") or NVME_PATH, sub_batch_size=knobs["sub_batch_size"],
                           num_sub_batches=knobs["num_sub_batches"], dtype=dtype)
    config = ds_config(spec, 1, hidden_size)
    for trial_only in ("train_batch_size", "steps_per_print", "wall_clock_breakdown"):
        del config[trial_only]
    lr = float(optimizer.get("lr", 1e-3))
    if optimizer.get("name", "adamw") == "sgd":
        # DeepSpeed builds torch.optim.SGD by name; ZeRO runs an optimizer it has not tested only when told to
        config["optimizer"] = {"type": "SGD", "params": {"lr": lr, "momentum": float(optimizer.get("momentum") or 0.0),
                                                         "weight_decay": float(optimizer.get("weight_decay") or 0.0)}}
        config["zero_allow_untested_optimizer"] = True
    else:
        decay = optimizer.get("weight_decay")
        params: dict[str, Any] = {"lr": lr, "betas": [float(b) for b in optimizer.get("betas", (0.9, 0.999))],
                                  "eps": float(optimizer.get("eps", 1e-8)),
                                  "weight_decay": 0.01 if decay is None else float(decay)}   # torch's AdamW default
        if (spec.offload_optimizer or "none") == "none":
            params["torch_adam"] = True     # torch.optim.AdamW, as the trial stepped (not FusedAdam's built op)
        config["optimizer"] = {"type": "AdamW", "params": params}
    config["scheduler"] = {"type": "WarmupLR", "params": {"warmup_min_lr": lr, "warmup_max_lr": lr,
                                                          "warmup_num_steps": 1, "warmup_type": "linear"}}
    return config


def deepspeed_json(config: Mapping[str, Any]) -> str:
    return json.dumps(config, indent=2) + "\n"


# -- accelerate (FSDP2) -------------------------------------------------------------------------------------------
def accelerate_config(knobs: Mapping[str, Any], *, dtype: str, world_size: int,
                      layer_classes: tuple[str, ...]) -> dict[str, Any]:
    """`accelerate launch --config_file FILE`'s config for the pick: FSDP2 with its offload and resharding, each
    decoder layer wrapped by class name (as the trial's fully_shard per layer), activation checkpointing as the
    trial recomputed, bf16 as the trial's MixedPrecisionPolicy. accelerate runs FSDP on GPUs only, so use_cpu is
    false whatever device the pick was tuned on."""
    return {
        "compute_environment": "LOCAL_MACHINE",
        "debug": False,
        "distributed_type": "FSDP",
        "downcast_bf16": "no",
        "enable_cpu_affinity": False,
        "fsdp_config": {
            "fsdp_version": 2,
            "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            "fsdp_transformer_layer_cls_to_wrap": ",".join(layer_classes),
            "fsdp_offload_params": bool(knobs.get("cpu_offload", DEFAULTS["cpu_offload"])),
            "fsdp_reshard_after_forward": bool(knobs.get("reshard_after_forward", DEFAULTS["reshard_after_forward"])),
            "fsdp_activation_checkpointing": knobs.get("activations", "recompute") == "recompute",
            "fsdp_cpu_ram_efficient_loading": False,     # the trial built the whole model on every rank
            "fsdp_state_dict_type": "FULL_STATE_DICT",   # whole weights saved, as `sltune train --save` does
        },
        "machine_rank": 0,
        "main_training_function": "main",
        "mixed_precision": "bf16" if dtype == "bfloat16" else "no",
        "num_machines": 1,
        "num_processes": int(world_size),
        "rdzv_backend": "static",
        "same_network": True,
        "tpu_env": [],
        "tpu_use_cluster": False,
        "tpu_use_sudo": False,
        "use_cpu": False,
    }


def accelerate_yaml(config: Mapping[str, Any], knobs: Mapping[str, Any], device: str) -> str:
    """The config as YAML, after comments saying what a config file of accelerate's cannot: the micro-batch and the
    accumulation (the training script's), and where the trial recomputed or offloaded activations."""
    b, n = knobs["sub_batch_size"], knobs["num_sub_batches"]
    lines = ["# sltune: an fsdp pick, for `accelerate launch --config_file FILE train.py` (accelerate with FSDP2)",
             (f"# a micro-batch of {b} row{'s' if b != 1 else ''} a process (sub_batch_size), gradients accumulated "
              f"over {n} (num_sub_batches): give them to your script, e.g. "
              f"Accelerator(gradient_accumulation_steps={n}) and a DataLoader of batch_size={b}")]
    if knobs.get("activations") == "offload":
        lines.append("# the trial kept autograd's saved tensors in host memory (torch.autograd.graph.save_on_cpu) "
                     "instead of recomputing them: wrap your forward and backward in it")
    if not str(device).startswith("cuda"):
        lines.append(f"# tuned on {device}: accelerate runs FSDP on GPUs only (use_cpu: false)")
    return "\n".join(lines) + "\n" + yaml.safe_dump(dict(config), sort_keys=False)
