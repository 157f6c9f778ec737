"""What --resume's verification costs (issue 47): every file of the checkpoint it picks read and checked, the disk
tier's hard-linked blocks included (sltune.training.checkpoints.verify), in seconds per GB.

A checkpoint of --model trained --steps steps with optimizer_offload and param_offload disk (llama-small: ~0.5 GB,
the blocks' float32 masters and AdamW's two moments and the weights); then, --rounds times, verify() with the
checkpoint's files evicted from the page cache first (posix_fadvise DONTNEED: a resume after a reboot, or of a
checkpoint written long ago) and again with them cached (a resume right after the save). Each check runs in a
fresh process (the blocks found whole are remembered in-process: in this process a second verify would only stat
them, which is the point of the cache, measured last). Median [min, max] seconds, and seconds per GB.

    python bench/resume_verify.py [--dir DIR] [--model llama-small] [--steps 2] [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CHECK = """
import sys, time
from sltune.training import checkpoints
t = time.perf_counter(); checkpoints.verify(sys.argv[1]); first = time.perf_counter() - t
t = time.perf_counter(); checkpoints.verify(sys.argv[1]); again = time.perf_counter() - t
print(first, again)
"""


def evict(folder: Path) -> None:
    for f in folder.rglob("*"):
        if f.is_file():
            fd = os.open(f, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} [{min(values):.3f}, {max(values):.3f}]"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", help="a folder on the disk to measure (default: a temporary one)")
    ap.add_argument("--model", default="llama-small")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    tmp = Path(args.dir or tempfile.mkdtemp(prefix="resume-verify-"))
    save = tmp / "R"
    subprocess.run([sys.executable, "-m", "sltune", "train", "--model", args.model, "--seq-len", "32", "--steps",
                    str(args.steps), "--optimizer-offload", "disk", "--param-offload", "disk", "--offload-dir",
                    str(tmp / "offload"), "--save", str(save), "--json"], check=True, stdout=subprocess.DEVNULL)
    files = [f for f in save.rglob("*") if f.is_file() and ".sltune-lock" not in f.name]
    nbytes = sum(f.stat().st_size for f in files)
    linked = sum(f.stat().st_size for f in files if "optimizer-rank" in str(f) and f.suffix == ".bin")
    print(f"{args.model}: {len(files)} files, {nbytes / 1e9:.3f} GB ({linked / 1e9:.3f} GB of them the disk tier's "
          f"blocks, hard-linked), in {tmp}")
    cold, warm, again = [], [], []
    for _ in range(args.rounds):
        for kind in ("cold", "warm"):
            if kind == "cold":
                evict(save)
            out = subprocess.run([sys.executable, "-c", CHECK, str(save)], check=True, capture_output=True,
                                 text=True, cwd=ROOT).stdout.split()
            (cold if kind == "cold" else warm).append(float(out[0]))
            again.append(float(out[1]))
    gb = nbytes / 1e9
    print(f"verify, page cache cold: {spread(cold)} s = {spread([t / gb for t in cold])} s/GB")
    print(f"verify, page cache warm: {spread(warm)} s = {spread([t / gb for t in warm])} s/GB")
    print(f"verify again in the same process (the blocks remembered, the other files hashed again): "
          f"{spread(again)} s")


if __name__ == "__main__":
    t0 = time.perf_counter()
    main()
    print(f"({time.perf_counter() - t0:.0f} s in all)")
