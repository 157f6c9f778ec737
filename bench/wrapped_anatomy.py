"""Where a wrapped backend's measured device peak comes from (issue #49 item 1): one step of each DeepSpeed and FSDP2
config, on the trial's own CPU allocation tracker, with the allocations alive at its peak grouped by the op and the
line that made them; beside each, the prior's device peak for the same config.

    DS_ACCELERATOR=cpu python bench/wrapped_anatomy.py [--model qwen2|PRESET] [--layers 2] [--dtype bfloat16]
                                                      [--seq-len 128] [--sub-batch-sizes 1,4] [--num-sub-batches 1]

The default model: qwen2-0.5b's widths (hidden 896, 14 heads, 2 KV heads, MLP 4864, vocab 151936, tied embeddings) at
--layers decoder layers, in --dtype with float32 masters and AdamW, one rank, N micro-batches of b rows: its tied
embedding holds 82% of the parameters at 2 layers (28% of the whole model's), so a term proportional to the largest
parameter shows. --model llama-tiny (or another preset) runs that model instead. Figures are bytes per parameter; the
prior's is sltune's own (sltune.tuning.cost.wrapped), from the shape alone. Each step a trial measures is shown: the
first makes AdamW's state, the second holds it; the trial's figure is the larger.

Known gap: FSDP2 without cpu_offload fails here ("Attempted to access the data pointer on an invalid python storage",
in AdamW's first zeros_like) while the same config's trial runs; its rows print "failed". The bench's own calls to
untyped_storage() on the ops' outputs are the suspect; its figures (17.98 B/param, 4 resident on the default model)
came from an earlier version of this script that read the tracker's own table of live storages.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import traceback
import weakref

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402

from sltune.backends import base, build  # noqa: E402
from sltune.backends.base import TrainingSpec  # noqa: E402
from sltune.models.presets import PRESETS  # noqa: E402
from sltune.profiling.schema import TrialSpec  # noqa: E402
from sltune.runtime.memory import CpuAllocationTracker  # noqa: E402

CONFIGS = [("deepspeed", {"zero_stage": 2}), ("deepspeed", {"zero_stage": 2, "offload_optimizer": "cpu"}),
           ("deepspeed", {"zero_stage": 3}), ("deepspeed", {"zero_stage": 3, "offload_optimizer": "cpu"}),
           ("deepspeed", {"zero_stage": 3, "offload_param": "cpu"}),
           ("deepspeed", {"zero_stage": 3, "offload_optimizer": "cpu", "offload_param": "cpu"}),
           ("fsdp", {"cpu_offload": False}), ("fsdp", {"cpu_offload": True})]


class Anatomy(CpuAllocationTracker):
    """The trial's tracker, also naming each allocation it counts (op, dtype, the first line outside torch), and
    keeping those alive when its peak last rose."""

    def __init__(self, limit: int | None, device: str):
        super().__init__(limit, device)
        self.alive: dict[int, tuple[str, int, weakref.ref]] = {}
        self.at_peak: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        before, peak = self.live, self.peak
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if self.live > before:
            where = next((f"{os.path.basename(f.filename)}:{f.lineno}:{f.name}"
                          for f in reversed(traceback.extract_stack()[:-1])
                          if "/torch/" not in f.filename and "wrapped_anatomy" not in f.filename), "?")
            for t in (out if isinstance(out, (tuple, list)) else (out,)):
                local = getattr(t, "_local_tensor", t)
                if isinstance(local, torch.Tensor) and not local.is_sparse:
                    st = local.untyped_storage()
                    key = st.data_ptr()
                    self.alive[key] = (f"{func.overloadpacket.__name__} {local.dtype} @{where}", st.nbytes(),
                                       weakref.ref(st))
        if self.peak > peak:
            self.alive = {k: v for k, v in self.alive.items() if v[2]() is not None}
            self.at_peak = [(what, n) for what, n, _ in self.alive.values()]
        return out


def prior_device(backend: str, b: int, n: int, knobs: dict, model: str | dict, dtype: str, seq_len: int) -> int:
    from sltune.tuning.cost.admission import load
    from sltune.tuning.cost.prior import predict

    search = {"backend": backend, "sub_batch_size": b, "num_sub_batches": n, backend: dict(knobs)}
    source = {"hf_config": model} if isinstance(model, dict) else {"preset": model}
    spec = {"name": "anatomy", "model": {**source, "dtype": dtype, "mixed_precision": True},
            "workload": {"seq_len": seq_len}, "search": search}
    admit = load(spec)
    full = {"offload_optimizer": "none", "offload_param": "none"} if backend == "deepspeed" else {}
    [candidate] = [c for c in admit.space.candidates
                   if all(getattr(c, k) == v for k, v in {**full, **knobs}.items())]
    return predict(admit.setup, candidate).device


def qwen_shape(layers: int) -> dict:
    """qwen2-0.5b's widths (its preset's) at `layers` decoder layers: an inline config."""
    preset = PRESETS["qwen2-0.5b"]
    return {"model_type": preset.family, **preset.kwargs, "num_hidden_layers": layers}


def one(backend: str, knobs: dict, b: int, n: int, model: str | dict, dtype: str, seq_len: int) -> None:
    """One config's step and its anatomy, printed (a process of its own: DeepSpeed keeps its process group)."""
    base.device_monitor = lambda device, limit: Anatomy(limit, str(device))
    spec = TrialSpec(model=model, dtype=dtype, mixed_precision=True, seq_len=seq_len,
                     sub_batch_size=b, num_sub_batches=n, backend=backend, **knobs)
    trial = build(backend, TrainingSpec.of(spec))
    prior = prior_device(backend, b, n, knobs, model, dtype, seq_len)
    count = sum(getattr(p, "ds_numel", p.numel()) for p in trial.model.parameters())
    for step in range(1, trial.measured_steps + 1):     # the first makes AdamW's state; the second holds it
        resident = trial.device_resident_bytes()
        result = trial.step(torch.randint(0, 64, (b * n, seq_len)))
        groups: collections.Counter[str] = collections.Counter()
        for what, nbytes in trial.memory.at_peak:
            groups[what] += nbytes
        print(f"{backend} b={b} N={n} {knobs} step {step}: measured {result.peak_device_bytes / count:.2f} B/param "
              f"(resident {resident / count:.2f}), prior {prior / count:.2f} "
              f"({100 * (prior / result.peak_device_bytes - 1):+.1f}%)", flush=True)
        for what, nbytes in groups.most_common(6):
            if nbytes > 0.02 * count:
                print(f"    {nbytes / count:6.2f}  {what}", flush=True)
    trial.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2", help="qwen2 (its widths at --layers) or a preset, e.g. llama-tiny")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--sub-batch-sizes", default="1,4")
    ap.add_argument("--num-sub-batches", type=int, default=1)
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args()
    model = qwen_shape(args.layers) if args.model == "qwen2" else args.model
    if args.one:
        backend, knobs, b = json.loads(args.one)
        return one(backend, knobs, b, args.num_sub_batches, model, args.dtype, args.seq_len)
    print(f"model {args.model} ({args.layers} layers)" if args.model == "qwen2" else f"model {args.model}",
          f"{args.dtype}, seq {args.seq_len}; bytes per parameter", flush=True)
    for backend, knobs in CONFIGS:
        for b in (int(x) for x in args.sub_batch_sizes.split(",")):
            run = subprocess.run([sys.executable, __file__, "--model", args.model, "--layers", str(args.layers),
                                  "--dtype", args.dtype, "--seq-len", str(args.seq_len), "--num-sub-batches",
                                  str(args.num_sub_batches),
                                  "--one", json.dumps([backend, knobs, b])], capture_output=True, text=True)
            lines = [x for x in run.stdout.splitlines() if x.startswith((backend, "    "))]
            print("\n".join(lines) if run.returncode == 0 else f"{backend} b={b} {knobs}: failed\n"
                  + run.stderr[-2000:], flush=True)


if __name__ == "__main__":
    main()
