"""Run under torchrun on 2 gloo ranks (each rank its own rows, its own shard of every unit); rank 0 reports.

`disk_dist_script.py OUT` (tests/integration/test_disk_tier.py): each config trained with optimizer_offload host and
disk; whether losses, gradient norms and the gathered masters are equal bit for bit, and each rank's counters.

`disk_dist_script.py OUT params` (tests/integration/test_param_offload_ranks.py): each config trained with
param_offload host and disk (both under optimizer_offload disk), the disk run saved part-way and resumed from its
checkpoint where a config says so; the same comparisons, each rank's dtype copies (its shards, from its files)
against the host run's, and what each rank's host memory held of the weights and gradients, measured.
"""

import gc
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

from sltune import SpeedLoaderConfig, SpeedLoaderEngine
from sltune.models import build
from sltune.models.presets import load_config

sys.path.insert(0, ".")
from tests.support.dist_script import PARTLY_FROZEN, freeze_all_but, write_report
from tests.support.reference import adamw

# stepped during the backward; and after it (clipping on the global norm over both ranks)
RUNS = [("llama-tiny", "recompute", None), ("qwen2-tiny", "offload", 0.05)]
STEPS, SEQ = 5, 16
# param_offload: (preset, dtype, activations, clip, the step the disk run is saved after and resumed from)
PARAM_RUNS = [("llama-tiny", "bfloat16", "recompute", None, 2),       # bf16 master on disk: stepped early
              ("llama-tiny-tied", "bfloat16", "offload", 0.05, None),  # tied embeddings, clipping: deferred, spilled
              ("llama-tiny", "float32", "recompute", 0.05, 2),         # no master: the files are the weights
              ("frozen", "bfloat16", "recompute", 0.05, None)]         # rank 1's share of the trainable prefix: none
PARAM_STEPS = 4
DEEP = 16       # layers of the model whose window is measured: many units, a few held at once


def batch(step: int, rank: int, rows: int = 4) -> torch.Tensor:
    return torch.randint(3, 512, (rows, SEQ), generator=torch.Generator().manual_seed(100 * step + rank))


def train(preset: str, acts: str, clip: float | None, offload: str, rank: int, folder: str):
    cfg = SpeedLoaderConfig(sub_batch_size=2, num_sub_batches=2, num_live_blocks=2, activations=acts,
                            dtype="bfloat16", optimizer_offload=offload,
                            offload_dir=folder if offload == "disk" else None)
    engine = SpeedLoaderEngine(build(preset, seed=0), cfg, optimizer=adamw, max_grad_norm=clip, track_grad_norm=True)
    results = []
    for step in range(STEPS):
        results.append(engine.train_step(batch(step, rank)))
    return engine, results


def optimizer_offload(out: str) -> None:
    rank = dist.get_rank()
    report = {}
    with tempfile.TemporaryDirectory() as folder:
        for preset, acts, clip in RUNS:
            host, host_res = train(preset, acts, clip, "host", rank, folder)
            disk, disk_res = train(preset, acts, clip, "disk", rank, folder)
            a, b = host.state_dict(), disk.state_dict()           # every rank gathers
            every = [None] * dist.get_world_size()
            dist.all_gather_object(every, {"io": disk_res[-1].io.as_dict(),
                                           "expected": disk.expected_io(SEQ).as_dict()})
            report[f"{preset}/{acts}/{clip}"] = {
                "losses": [[r.loss for r in host_res], [r.loss for r in disk_res]],
                "norms": [[r.grad_norm for r in host_res], [r.grad_norm for r in disk_res]],
                "weights_equal": all(torch.equal(a[k], b[k]) for k in a), "io": every,
                "early": disk.last_stepping.early}
    write_report(report, out)


def params_config(param: str, dtype: str, acts: str, folder: str, **knobs) -> SpeedLoaderConfig:
    knobs = {"sub_batch_size": 2, "num_sub_batches": 2, "num_live_blocks": 2, **knobs}
    return SpeedLoaderConfig(**knobs, activations=acts, dtype=dtype, optimizer_offload="disk", param_offload=param,
                             offload_dir=folder)


def resumed(engine: SpeedLoaderEngine, cfg: SpeedLoaderConfig, clip: float | None, step: int,
            path: Path) -> SpeedLoaderEngine:
    """A checkpoint of `engine` after `step` steps, and a new engine resumed from it as `sltune train --resume`
    builds one (the exact weights, each rank's optimizer files adopted)."""
    from sltune.models.checkpoint import Checkpoint
    from sltune.training import checkpoints

    checkpoints.save_checkpoint(path, engine, {"step": step}, save_dtype=getattr(torch, cfg.dtype))
    found, trainer = checkpoints.latest(path) if dist.get_rank() == 0 else (None, None)
    found, trainer = checkpoints.agree(found, trainer)
    source = Checkpoint(found)
    exact = checkpoints.exact_weights(found)
    if exact is not None:
        source.use_weights(exact)
    again = SpeedLoaderEngine(source.empty_model(), cfg, optimizer=adamw, weights=source, max_grad_norm=clip,
                              track_grad_norm=True)
    checkpoints.restore(found, trainer, again)
    return again


def param_offload(out: str) -> None:
    rank = dist.get_rank()
    report = {}
    shared = Path(out).parent       # the checkpoints: one folder every rank writes in (each its own temporary one
                                    # holds its engine's files)
    with tempfile.TemporaryDirectory() as folder:
        for preset, dtype, acts, clip, resume in PARAM_RUNS:
            runs = {}
            for param in ("host", "disk"):
                cfg = params_config(param, dtype, acts, folder)
                model = build(preset, seed=0) if preset != "frozen" else \
                    freeze_all_but(build("llama-tiny", seed=0), PARTLY_FROZEN)
                engine = SpeedLoaderEngine(model, cfg, optimizer=adamw, max_grad_norm=clip, track_grad_norm=True)
                results = []
                for step in range(PARAM_STEPS):
                    if param == "disk" and step == resume:
                        engine = resumed(engine, cfg, clip, step, shared / f"ckpt-{preset}-{dtype}")
                    results.append(engine.train_step(batch(step, rank)))
                runs[param] = engine, results
            (host, a), (disk, b) = runs["host"], runs["disk"]
            ours, theirs = host.state_dict(), disk.state_dict()           # every rank gathers
            copies = all(torch.equal(u.host, disk.params.weight_values(v)) for u, v in zip(host.units, disk.units)
                         if u.host is not None)
            every = [None] * dist.get_world_size()
            dist.all_gather_object(every, {
                "io": b[-1].io.as_dict(), "expected": disk.expected_io(SEQ).as_dict(), "copies_equal": copies,
                "placeholders": all(u.host.untyped_storage().nbytes() <= 4 for u in disk.units if u.host is not None),
                "folder": str(disk.weights.folder), "files": len(list(disk.weights.folder.glob("w*.bin")))})
            report[f"{preset}/{dtype}/{acts}/{clip}/{resume}"] = {
                "losses": [[r.loss for r in a], [r.loss for r in b]],
                "norms": [[r.grad_norm for r in a], [r.grad_norm for r in b]],
                "weights_equal": ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours),
                "early": disk.last_stepping.early, "units": len([u for u in disk.units if u.host is not None]),
                "ranks": every}
            del runs, host, disk
        report["window"] = window(rank, folder)
    write_report(report, out)


def window(rank: int, folder: str) -> list[dict]:
    """A deep model (DEEP layers, a unit each), two steps: what each rank's window of shards and of gradient shards
    held at its peak, beside all of that rank's shards together."""
    config = load_config("llama-tiny").to_dict()
    config["num_hidden_layers"] = DEEP
    engine = SpeedLoaderEngine(build(config, seed=0),
                               params_config("disk", "bfloat16", "recompute", folder, sub_batch_size=1,
                                             num_live_blocks=1), optimizer=adamw)
    for step in range(2):
        engine.train_step(batch(step, rank, rows=2))
    units = [u for u in engine.units if u.host is not None]
    grads = engine.params.grads
    every = [None] * dist.get_world_size()
    mine = {
        "units": len(units), "shard_bytes": sum(u.nbytes for u in units),
        "largest_shard": max(u.nbytes for u in units), "peak_window_bytes": engine.weights.peak_window_bytes,
        "window_bytes_now": engine.weights.window_bytes,
        "held_between_steps": sum(u.host.untyped_storage().nbytes() for u in units),
        "grad_shard_bytes": sum(engine.params.host_grad_numel(u) * 4 for u in units),
        "grad_peak_bytes": grads.peak_bytes, "grad_budget": grads.budget}
    # dropping the engine removes its folder at once: no reference cycle keeps it until a garbage collection (a
    # trial's ranks but 0 exit without one, which left their folders behind)
    folder = engine.weights.folder
    gc.disable()
    try:
        del engine, units, grads
        mine["folder_gone_at_del"] = not folder.exists()
    finally:
        gc.enable()
    dist.all_gather_object(every, mine)
    return every


if __name__ == "__main__":
    dist.init_process_group("gloo")
    if sys.argv[2:] == ["params"]:
        param_offload(sys.argv[1])
    else:
        optimizer_offload(sys.argv[1])
