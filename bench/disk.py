"""The disk tier (optimizer_offload: disk) at the largest shape the free disk holds, against the disk's own sequential
speed (dd) and DeepSpeed ZeRO-Infinity; and per-unit optimizer stepping under optimizer_offload: host.

    python bench/disk.py [--dir DIR] [--model auto] [--b 1] [--n 4] [--seq 32] [--steps 3] [--rounds 3]
                         [--activations recompute|offload] [--param-offload disk|host]
                         [--no-deepspeed] [--overlap-model llama-medium] [--overlap-steps 6]

--model auto takes the first of qwen2-1.5b, qwen2-0.5b, llama-medium, llama-small whose files fit the free disk of
--dir (sltune holds two versions of the float32 master and AdamW's moments during a step, its default
disk_versions 2: 2 * 12 bytes per parameter; disk_versions 1 keeps one), bf16 compute with float32 masters (mixed
precision) and AdamW. The host memory limit is what
optimizer_offload host would hold (the weights, master, gradients and moments, sltune.tuning.cost.shape) plus the
process's own, less a byte: host cannot run under it (on the CPU its device buffers come on top); sltune runs in a process of its own, killed if its resident memory
crosses the limit (DeepSpeed's peak is reported against it). Either is stopped if the machine, shared, falls under
1 GiB available.

A round runs, one after the other on the same directory: dd's sequential write and read (64 MiB blocks, O_DIRECT,
fdatasync), sltune (--steps steps; the weights' dtype copy in files too under --param-offload disk, the default),
and DeepSpeed ZeRO-Infinity (ZeRO-3, the optimizer state on NVMe through its async_io op (libaio), the parameters
on NVMe too under --param-offload disk, else in host memory (cpu); its CPU Adam, bf16, the same micro-batch and
accumulation steps: the same effective batch). The first step of each is not counted (sltune's reads only the
masters, the moments do not exist yet). Figures are medians over the rounds' counted steps with [min, max].
sltune's disk MB/s is the bytes of a step over the time a read (or a write) was in flight; "hidden" is the share of
the disk's busy time the step did not wait for (sltune.runtime.stepping.StepTimeline). The ratio is each round's
DeepSpeed step time over sltune's, median [min, max] over rounds (goal >= 1.3, issue #34; --activations offload
is like for like, as DeepSpeed's ZeRO-3 here recomputes nothing).

Last, per-unit stepping under optimizer_offload host (--overlap-model, in one process): the optimizer steps each
unit on a thread as the backward finishes its gradients (overlap_optimizer=True) against one step after the
backward, steps interleaved, both engines from the same weights (their losses must agree to the bit).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()
CANDIDATES = ("qwen2-1.5b", "qwen2-0.5b", "llama-medium", "llama-small")
GiB = 1 << 30


def spread(values: list[float], fmt: str = "{:.2f}") -> str:
    if not values:
        return "-"
    return f"{fmt.format(statistics.median(values))} [{fmt.format(min(values))}, {fmt.format(max(values))}]"


# -- the children ------------------------------------------------------------------------------------------
def peak_rss() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def sltune_child(args: argparse.Namespace) -> dict[str, Any]:
    import sltune  # noqa: F401  (OMP_WAIT_POLICY before torch)
    import torch

    from sltune import SpeedLoaderConfig, SpeedLoaderEngine
    from sltune.training.data import batches
    from sltune.models import load_config
    from sltune.models.seeded import SeededWeights
    from sltune.training import OptimizerConfig

    cfg = SpeedLoaderConfig(sub_batch_size=args.b, num_sub_batches=args.n, num_live_blocks=1, dtype="bfloat16",
                            activations=args.activations, optimizer_offload="disk", param_offload=args.param_offload,
                            offload_dir=args.dir)
    start = time.perf_counter()
    weights = SeededWeights(load_config(args.model), 0)
    engine = SpeedLoaderEngine(weights.empty_model(), cfg, optimizer=OptimizerConfig(lr=1e-5).factory, weights=weights)
    setup = time.perf_counter() - start
    data = batches(args.b * args.n, args.seq, engine.model.config.vocab_size, seed=0)
    steps = []
    for _ in range(args.steps):
        res = engine.train_step(next(data))
        t = engine.last_stepping
        steps.append({"seconds": res.seconds, "loss": res.loss, "read": res.io.disk_read_bytes,
                      "write": res.io.disk_write_bytes, "read_busy": t.read_busy_s, "write_busy": t.write_busy_s,
                      "busy": t.disk_busy_s, "exposed": t.exposed_s, "hidden": t.disk_hidden,
                      "optimizer": t.optimizer_s, "waited": t.waited_s})
    return {"setup_s": setup, "steps": steps, "peak_rss": peak_rss(), "direct": engine.disk.direct,
            "window": engine.disk.window_bytes, "blocks": len(engine.disk.blocks),
            "params": sum(p.numel() for p in engine.model.parameters()), "threads": torch.get_num_threads()}


def deepspeed_child(args: argparse.Namespace) -> dict[str, Any]:
    import sltune  # noqa: F401
    import torch

    from sltune.training.data import batches
    from sltune.models import load_config
    from transformers import AutoModelForCausalLM

    sys.path.insert(0, str(HERE.parent))
    from peers import deepspeed_or_none     # one gloo rank on DeepSpeed's CPU accelerator, as bench/peers.py runs it

    deepspeed = deepspeed_or_none()
    nvme = Path(args.dir) / f"deepspeed-{os.getpid()}"
    nvme.mkdir(parents=True)
    start = time.perf_counter()
    # built whole in bf16, then partitioned by initialize (transformers' weight init indexes into the empty
    # partitions zero.Init leaves)
    model = AutoModelForCausalLM.from_config(load_config(args.model), dtype=torch.bfloat16)
    # ZeRO-Infinity's parameter swapper holds whole parameters in buffers of buffer_size values: the largest one
    # (the embedding) must fit one
    largest = max(p.numel() for p in model.parameters())
    param = ({"device": "nvme", "nvme_path": str(nvme), "pin_memory": False, "buffer_count": 5,
              "buffer_size": largest} if args.param_offload == "disk" else {"device": "cpu", "pin_memory": False})
    ds = {"train_micro_batch_size_per_gpu": args.b, "gradient_accumulation_steps": args.n,
          "bf16": {"enabled": True}, "gradient_clipping": 0.0, "steps_per_print": 10**9,
          "wall_clock_breakdown": False,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-5, "betas": [0.9, 0.999], "eps": 1e-8,
                                                    "weight_decay": 0.01}},
          "zero_optimization": {"stage": 3, "offload_param": param,
                                "offload_optimizer": {"device": "nvme", "nvme_path": str(nvme), "pin_memory": False},
                                "overlap_comm": False},
          "aio": {"block_size": 1 << 20, "queue_depth": 8, "thread_count": 1, "single_submit": False,
                  "overlap_events": True}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds)
    setup = time.perf_counter() - start
    data = batches(args.b * args.n, args.seq, model.config.vocab_size, seed=0)
    steps = []
    try:
        for _ in range(args.steps):
            batch = next(data)
            start = time.perf_counter()
            total = 0.0
            for i in range(args.n):
                mb = batch[i * args.b:(i + 1) * args.b]
                loss = engine(input_ids=mb, labels=mb).loss
                engine.backward(loss)
                engine.step()
                total += loss.item() / args.n
            steps.append({"seconds": time.perf_counter() - start, "loss": total})
    finally:
        shutil.rmtree(nvme, ignore_errors=True)
    return {"setup_s": setup, "steps": steps, "peak_rss": peak_rss(), "version": deepspeed.__version__}


def overlap_child(args: argparse.Namespace) -> dict[str, Any]:
    import sltune  # noqa: F401
    import torch

    from sltune import SpeedLoaderConfig, SpeedLoaderEngine
    from sltune.training.data import batches
    from sltune.models import load_config
    from sltune.models.seeded import SeededWeights
    from sltune.training import OptimizerConfig

    cfg = SpeedLoaderConfig(sub_batch_size=args.b, num_sub_batches=args.n, num_live_blocks=1, dtype="bfloat16")
    engines = {}
    for overlap in (False, True):
        weights = SeededWeights(load_config(args.overlap_model), 0)
        engines[overlap] = SpeedLoaderEngine(weights.empty_model(), cfg, optimizer=OptimizerConfig(lr=1e-5).factory,
                                             weights=weights, overlap_optimizer=overlap)
    stream = batches(args.b * args.n, args.seq, engines[False].model.config.vocab_size, seed=0)
    data = [next(stream) for _ in range(args.overlap_steps)]
    out = {False: [], True: []}
    losses = {False: [], True: []}
    for i, batch in enumerate(data):
        for overlap in ((False, True) if i % 2 == 0 else (True, False)):
            res = engines[overlap].train_step(batch)
            out[overlap].append(res.seconds)
            losses[overlap].append(res.loss)
    return {"after": out[False][1:], "overlap": out[True][1:], "same_losses": losses[False] == losses[True],
            "optimizer_s": engines[True].last_stepping.optimizer_s, "waited_s": engines[True].last_stepping.waited_s,
            "params": sum(p.numel() for p in engines[False].model.parameters()), "threads": torch.get_num_threads()}


# -- the parent --------------------------------------------------------------------------------------------
def available() -> int:
    for line in open("/proc/meminfo"):
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 1 << 62


def run_child(kind: str, args: argparse.Namespace, limit: int | None) -> dict[str, Any]:
    """The child in a process of its own, killed above `limit` bytes resident, or when the machine has less than
    1 GiB available (the machine is shared: its other processes are not to be pushed out); its JSON, or its
    failure."""
    import psutil

    cmd = [sys.executable, str(HERE), "--child", kind, *sys.argv[1:]]
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, text=True)
        peak, killed, low = 0, False, False
        ps = psutil.Process(proc.pid)
        while proc.poll() is None:
            try:
                rss = ps.memory_info().rss
            except psutil.Error:
                break
            peak = max(peak, rss)
            if (limit is not None and rss > limit) or available() < GiB:
                proc.kill()
                killed = True
                low = available() < GiB
            time.sleep(0.2)
        proc.wait()
        out.seek(0)
        err.seek(0)
        lines = [line for line in out.read().splitlines() if line.startswith("{")]
        if killed and low:
            return {"error": f"stopped at {peak / GiB:.2f} GiB resident: the machine had under 1 GiB available"}
        if killed:
            return {"error": f"killed: resident memory {peak / GiB:.2f} GiB crossed the limit {limit / GiB:.2f} GiB"}
        if proc.returncode != 0 or not lines:
            tail = err.read().strip().splitlines()[-12:]
            return {"error": f"exit {proc.returncode}:\n      " + "\n      ".join(tail)}
        return json.loads(lines[-1])


def dd(folder: Path, gib: int) -> tuple[float, float]:
    """dd's sequential write and read of `gib` GiB in 64 MiB blocks with O_DIRECT (write flushed): MB/s each."""
    path = folder / "dd-test"

    def rate(cmd: list[str]) -> float:
        r = subprocess.run(cmd, capture_output=True, text=True, check=True)
        m = re.search(r"(\d+) bytes .* copied, ([\d.]+) s", r.stderr)
        return int(m.group(1)) / float(m.group(2)) / 1e6

    try:
        w = rate(["dd", "if=/dev/zero", f"of={path}", "bs=64M", f"count={16 * gib}", "oflag=direct",
                  "conv=fdatasync"])
        r = rate(["dd", f"if={path}", "of=/dev/null", "bs=64M", "iflag=direct"])
    finally:
        path.unlink(missing_ok=True)
    return w, r


def deepspeed_status() -> str | None:
    """None when DeepSpeed and its async_io op load here; else what failed."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        import deepspeed  # noqa: F401
        from deepspeed.ops.op_builder import AsyncIOBuilder, CPUAdamBuilder
    except ImportError as err:
        return f"DeepSpeed is not installed ({err}); pip install deepspeed"
    for builder in (AsyncIOBuilder(), CPUAdamBuilder()):
        if not builder.is_compatible(verbose=True):
            return f"DeepSpeed's {builder.NAME} op is not compatible with this machine (libaio-dev missing?)"
        try:
            builder.load(verbose=False)
        except Exception as err:     # noqa: BLE001 - whatever the toolchain raised is the reason
            return f"DeepSpeed's {builder.NAME} op failed to build or load: {type(err).__name__}: {err}"
    return None


def baseline_rss() -> int:
    """What a process that imported torch, transformers and sltune holds before any model: the limit's allowance
    for it (this process has imported them)."""
    import sltune.runtime.engine  # noqa: F401

    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def pick_model(args: argparse.Namespace, free: int) -> str:
    from sltune.models import param_count

    if args.model != "auto":
        return args.model
    for name in CANDIDATES:
        if 2 * 12 * param_count(name) * 1.05 <= free:
            return name
    raise SystemExit(f"{args.dir}: {free / GiB:.1f} GiB free holds none of {', '.join(CANDIDATES)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default=None, help="where the optimizer's files go (default: a folder in /var/tmp)")
    ap.add_argument("--model", default="auto")
    ap.add_argument("--b", type=int, default=1)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--activations", choices=("recompute", "offload"), default="recompute",
                    help="sltune's: recompute runs each group's forward again in the backward (DeepSpeed's ZeRO-3 "
                         "here does not checkpoint activations); offload keeps autograd's saved tensors instead")
    ap.add_argument("--param-offload", choices=("disk", "host"), default="disk",
                    help="disk: sltune's weights in files too, against DeepSpeed's offload_param nvme (the issue's "
                         "comparison); host: sltune's in host memory, DeepSpeed's offload_param cpu")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dd-gib", type=int, default=2)
    ap.add_argument("--no-deepspeed", action="store_true")
    ap.add_argument("--no-disk", action="store_true", help="only the host per-unit stepping part")
    ap.add_argument("--no-overlap", action="store_true", help="skip the host per-unit stepping part")
    ap.add_argument("--overlap-model", default="llama-medium")
    ap.add_argument("--overlap-steps", type=int, default=7)
    ap.add_argument("--child", choices=("sltune", "deepspeed", "overlap"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.dir is None:
        args.dir = "/var/tmp/sltune-disk-bench"
    Path(args.dir).mkdir(parents=True, exist_ok=True)
    if args.child:
        if args.model == "auto":
            args.model = pick_model(args, shutil.disk_usage(args.dir).free)
        child = {"sltune": sltune_child, "deepspeed": deepspeed_child, "overlap": overlap_child}[args.child]
        print(json.dumps(child(args)), flush=True)
        return

    if not args.no_disk:
        disk_part(args)
    if not args.no_overlap:
        overlap_part(args)


def disk_part(args: argparse.Namespace) -> None:
    from sltune.models import param_count
    from sltune.tuning.cost.shape import shape_of

    folder = Path(args.dir)
    free = shutil.disk_usage(folder).free
    args.model = pick_model(args, free)
    params = param_count(args.model)
    terms = shape_of(args.model, "bfloat16").host_terms("train", True)
    host_need = sum(n for _, n in terms)
    limit = baseline_rss() + host_need - 1
    fs = subprocess.run(["df", "-T", str(folder)], capture_output=True, text=True).stdout.splitlines()[-1].split()[1]
    print(f"{args.model}: {params / 1e9:.2f}B parameters, bf16 with float32 masters, AdamW, weights on "
          f"{args.param_offload} (DeepSpeed's offload_param {'nvme' if args.param_offload == 'disk' else 'cpu'}); "
          f"b={args.b} N={args.n} "
          f"s={args.seq}, sltune's activations {args.activations}: {args.b * args.n * args.seq} tokens a step; {args.steps} steps a run, {args.rounds} rounds")
    print(f"optimizer_offload host would hold {host_need / GiB:.1f} GiB ("
          + ", ".join(f"{w} {n / GiB:.1f}" for w, n in terms) + f") besides the process; limit {limit / GiB:.1f} GiB "
          f"(the process's {baseline_rss() / GiB:.1f} GiB and that, less a byte), this machine has "
          f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / GiB:.1f} GiB")
    print(f"{folder} ({fs}): {free / GiB:.1f} GiB free; sltune keeps two versions (disk_versions 2), "
          f"{2 * 12 * params / GiB:.1f} GiB")
    ds_error = "skipped (--no-deepspeed)" if args.no_deepspeed else deepspeed_status()
    if ds_error:
        print(f"DeepSpeed ZeRO-Infinity: not run: {ds_error}")
    rows: dict[str, list] = {"dd_w": [], "dd_r": [], "sl": [], "ds": []}
    for r in range(args.rounds):
        w, rd = dd(folder, args.dd_gib)
        rows["dd_w"].append(w)
        rows["dd_r"].append(rd)
        sl = run_child("sltune", args, limit)
        rows["sl"].append(sl)
        ds = run_child("deepspeed", args, None) if not ds_error else None     # its peak is reported instead
        rows["ds"].append(ds)
        line = f"round {r + 1}: dd write {w:.0f} read {rd:.0f} MB/s; sltune "
        line += f"{sl['error']}" if "error" in sl else " ".join(f"{s['seconds']:.1f}" for s in sl["steps"]) + " s"
        if ds is not None:
            line += "; DeepSpeed " + (ds["error"] if "error" in ds else
                                      " ".join(f"{s['seconds']:.1f}" for s in ds["steps"]) + " s")
        print(line, flush=True)
    report(args, rows, limit)


def report(args: argparse.Namespace, rows: dict[str, list], limit: int) -> None:
    ok = [s for s in rows["sl"] if "error" not in s]
    print(f"\ndd on the same folder: write {spread(rows['dd_w'], '{:.0f}')} MB/s, read {spread(rows['dd_r'], '{:.0f}')} "
          "MB/s")
    if not ok:
        print("sltune: every run failed")
        return
    counted = [st for s in ok for st in s["steps"][1:]]
    tokens = args.b * args.n * args.seq
    first = ok[0]
    print(f"sltune disk ({'O_DIRECT' if first['direct'] else 'buffered'}, {first['blocks']} blocks, window "
          f"{first['window'] / GiB:.2f} GiB, {first['threads']} threads): step {spread([s['seconds'] for s in counted])} s, "
          f"{spread([tokens / s['seconds'] for s in counted], '{:.1f}')} tokens/s; setup "
          f"{spread([s['setup_s'] for s in ok], '{:.0f}')} s")
    print(f"  per step: read {counted[0]['read'] / 1e9:.2f} GB, written {counted[0]['write'] / 1e9:.2f} GB; read "
          f"{spread([s['read'] / s['read_busy'] / 1e6 for s in counted], '{:.0f}')} MB/s, write "
          f"{spread([s['write'] / s['write_busy'] / 1e6 for s in counted], '{:.0f}')} MB/s, both "
          f"{spread([(s['read'] + s['write']) / s['busy'] / 1e6 for s in counted], '{:.0f}')} MB/s while busy")
    print(f"  disk busy {spread([s['busy'] for s in counted])} s a step, hidden under compute "
          f"{spread([100 * s['hidden'] for s in counted], '{:.0f}')} %; optimizer {spread([s['optimizer'] for s in counted])} s; "
          f"waited after the backward {spread([s['waited'] for s in counted])} s")
    print(f"  peak host memory {spread([s['peak_rss'] / GiB for s in ok])} GiB (limit {limit / GiB:.1f}); losses "
          + " ".join(f"{s['loss']:.4f}" for s in ok[0]["steps"]))
    ds = [d for d in rows["ds"] if d is not None and "error" not in d]
    if not ds:
        return
    ds_counted = [st for d in ds for st in d["steps"][1:]]
    print(f"DeepSpeed {ds[0]['version']} ZeRO-Infinity: step {spread([s['seconds'] for s in ds_counted])} s, "
          f"{spread([tokens / s['seconds'] for s in ds_counted], '{:.1f}')} tokens/s; setup "
          f"{spread([d['setup_s'] for d in ds], '{:.0f}')} s; peak host memory {spread([d['peak_rss'] / GiB for d in ds])} "
          f"GiB (sltune's limit {limit / GiB:.1f}, not applied to it); losses "
          + " ".join(f"{s['loss']:.4f}" for s in ds[0]["steps"]))
    ratios = [statistics.median(s["seconds"] for s in d["steps"][1:]) /
              statistics.median(s["seconds"] for s in sl["steps"][1:])
              for sl, d in zip(rows["sl"], rows["ds"]) if d is not None and "error" not in d and "error" not in sl]
    print(f"DeepSpeed step time / sltune's, per round: {spread(ratios)}  (goal >= 1.3)")


def overlap_part(args: argparse.Namespace) -> None:
    print(f"\nper-unit stepping under optimizer_offload host ({args.overlap_model}, b={args.b} N={args.n} s={args.seq}, "
          f"{args.overlap_steps} steps each, interleaved, the first not counted):")
    res = run_child("overlap", args, None)
    if "error" in res:
        print(f"  failed: {res['error']}")
        return
    ratios = [a / o for a, o in zip(res["after"], res["overlap"])]
    print(f"  {res['params'] / 1e6:.0f}M parameters, {res['threads']} threads: one step after the backward "
          f"{spread(res['after'], '{:.3f}')} s, each unit during the backward {spread(res['overlap'], '{:.3f}')} s; "
          f"ratio {spread(ratios, '{:.3f}')} (>1: overlap faster); losses equal: {res['same_losses']}; the optimizer "
          f"{res['optimizer_s']:.3f} s, of which waited for after the backward {res['waited_s']:.3f} s")


if __name__ == "__main__":
    main()
