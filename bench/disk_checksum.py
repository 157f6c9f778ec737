"""What the disk tier's checksums cost (issue 31 M3): hashing a block against reading it, and a training step.

1. Raw: a block file as large as the tier writes (16 Mi values of float32 master and AdamW's two moments: 192 MiB)
   is read with O_DIRECT (sltune.runtime.disk.direct_io) and hashed with xxh3_64 (the xxhash package) and zlib's crc32,
   interleaved, --rounds times over --files files (so no read is of a file just read). GB/s per round: median
   [min, max], and the hash's time as a share of the read's.
2. A step: llama-small (bf16, AdamW, optimizer_offload disk, one row of 32 tokens: the disk dominates) in a
   process per config and round (in one process the first engine built steps 40% slower, whatever its config),
   configs interleaved, each first in turn: no checksums at all, xxh3 written and verified on resume/checkpoint
   reads only, xxh3 verified on every read too (the default), and crc32 verified on every read. Median [min, max]
   over --rounds processes x --steps steps, after one warm-up step each.

    python bench/disk_checksum.py [--dir DIR] [--rounds 5] [--files 3] [--steps 6] [--model llama-small]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import zlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def spread(values: list[float], fmt: str = "{:.2f}") -> str:
    return f"{fmt.format(statistics.median(values))} [{fmt.format(min(values))}, {fmt.format(max(values))}]"


def raw(folder: Path, rounds: int, files: int) -> None:
    import xxhash

    from sltune.runtime.disk.direct_io import DirectFiles, aligned_empty

    n = 3 * (16 << 20) * 4
    io = DirectFiles(folder)
    buf = aligned_empty(n)
    buf.random_(0, 255)
    paths = [folder / f"block{i}.bin" for i in range(files)]
    for p in paths:
        io.write(p, buf, n)
    hashes = {"xxh3_64": xxhash.xxh3_64_intdigest, "crc32": zlib.crc32}
    read_gbs: list[float] = []
    hash_gbs: dict[str, list[float]] = {k: [] for k in hashes}
    share: dict[str, list[float]] = {k: [] for k in hashes}
    values = buf.numpy()
    for r in range(rounds):
        for i, p in enumerate(paths):
            start = time.perf_counter()
            io.read(p, buf, n)
            took = time.perf_counter() - start
            read_gbs.append(n / took / 1e9)
            for name in (list(hashes) if (r + i) % 2 == 0 else list(hashes)[::-1]):
                start = time.perf_counter()
                hashes[name](values[:n])
                h = time.perf_counter() - start
                hash_gbs[name].append(n / h / 1e9)
                share[name].append(100 * h / took)
    for p in paths:
        p.unlink()
    print(f"block of {n / 2**20:.0f} MiB, O_DIRECT={io.direct}, {len(read_gbs)} reads")
    print(f"  read           {spread(read_gbs)} GB/s")
    for name in hashes:
        print(f"  {name:14s} {spread(hash_gbs[name])} GB/s; hashing takes {spread(share[name], '{:.0f}')} % of "
              "the read's time")


_CHILD = """
import json, sys, time
import torch
from sltune import SpeedLoaderConfig, SpeedLoaderEngine
from sltune.models import build
from sltune.runtime.disk import files, state
from sltune.training import OptimizerConfig
folder, model, checksum, verify, n = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4] == "1", int(sys.argv[5])
files.CHECKSUMS["none"] = lambda values: 0
files.CHECKSUM = state.CHECKSUM = checksum      # what the engine sums its new files with, and checks them by
cfg = SpeedLoaderConfig(dtype="bfloat16", num_live_blocks=1, optimizer_offload="disk", offload_dir=folder)
engine = SpeedLoaderEngine(build(model, seed=0), cfg, optimizer=OptimizerConfig().factory)
engine.disk.verify_reads = verify
ids = torch.randint(3, 100, (1, 32), generator=torch.Generator().manual_seed(0))
engine.train_step(ids)                          # the first step reads only the masters
times = []
for _ in range(n):
    start = time.perf_counter()
    engine.train_step(ids)
    times.append(time.perf_counter() - start)
print(json.dumps({"times": times, "files": sum(b.numel for b in engine.disk.blocks) * 12}))
"""

CONFIGS = {"no checksums": ("none", False), "xxh3, resume/checkpoint reads": ("xxh3_64", False),
           "xxh3, every read (default)": ("xxh3_64", True), "crc32, every read": ("crc32", True)}


def steps(folder: Path, model: str, n_steps: int, rounds: int) -> None:
    import json
    import subprocess

    times: dict[str, list[float]] = {k: [] for k in CONFIGS}
    order, files = list(CONFIGS), 0
    for r in range(rounds):
        for name in order[r % len(order):] + order[:r % len(order)]:          # each config first in turn
            checksum, verify = CONFIGS[name]
            out = subprocess.run([sys.executable, "-c", _CHILD, str(folder), model, checksum, str(int(verify)),
                                  str(n_steps)], capture_output=True, text=True, cwd=ROOT, check=True)
            got = json.loads(out.stdout.strip().splitlines()[-1])
            times[name] += got["times"]
            files = got["files"]
    print(f"{model}: {files / 2**20:.0f} MiB of optimizer files read and written a step; step time over {rounds} "
          f"processes a config x {n_steps} steps")
    base = statistics.median(times["no checksums"])
    for name, ts in times.items():
        print(f"  {name:32s} {spread(ts, '{:.3f}')} s  ({100 * (statistics.median(ts) / base - 1):+.1f} %)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=None, help="a folder on the disk to measure (default: a temporary one)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--files", type=int, default=3)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--model", default="llama-small")
    ap.add_argument("--skip-steps", action="store_true")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        raw(Path(tmp), args.rounds, args.files)
        if not args.skip_steps:
            steps(Path(tmp), args.model, args.steps, args.rounds)


if __name__ == "__main__":
    main()
