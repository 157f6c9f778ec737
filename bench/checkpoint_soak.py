"""Kill -9 `sltune train --save R --save-every K --keep M [--resume R]` over and over, then check that nothing lied.

    python bench/checkpoint_soak.py [--kills 60] [--random-share 0.3] [--max-steps 24] [--seed 0] [--dir DIR]
                                    [--disk] [--model llama-tiny]

Each segment is a run forked from this process (torch already imported: it starts at once) that continues R from
its newest checkpoint to a few steps further (a random --save-every 1-3 and --keep 1-3), so it writes checkpoint-N
folders, rotates them and replaces the final folder R itself. It is killed (SIGKILL) either from inside, at a
named point of sltune.training.checkpoints (SLTUNE_CRASH_AT=point@n, cycling through every point, first and second
time), or from outside at a random moment. After every kill:

- every visible checkpoint-N folder and R itself (when it has a training_state) must verify (manifest, sizes,
  checksums, one step of one run), else it is counted as a visible incomplete checkpoint;
- the newest complete checkpoint must be at least as new as before the segment, else a checkpoint was lost (as it
  is when nothing is left to resume);
- its float32 weights must equal the uninterrupted reference run's at that step, and every loss the segment logged
  must equal the reference's at that step (mismatches).

When R reaches --max-steps a fresh run replaces it (--overwrite). At the end R is run to --max-steps without a kill
and compared as well. Prints the counts; exit 1 if any mismatch, loss or incomplete checkpoint was seen.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parents[1]))

from safetensors.torch import load_file  # noqa: E402

from sltune import SpeedLoaderConfig  # noqa: E402
from sltune.training import checkpoints  # noqa: E402
from sltune.training.loop import TrainJob, run  # noqa: E402


def exact_weights(folder: Path) -> dict[str, torch.Tensor]:
    exact = folder / "training_state" / "weights.safetensors"
    return load_file(exact if exact.is_file() else folder / "model.safetensors")


def checksum_cost(root: Path, mib: int = 100) -> str:
    """What a checkpoint's checksums cost: a file of `mib` MiB (in the page cache, as one just written is) read
    alone, hashed with xxh3_64 (xxhash) and zlib's crc32, and hashed and flushed as a save does (checkpoints.record);
    best of 3."""
    import zlib

    file = root / "checksum-cost.bin"
    file.write_bytes(os.urandom(mib << 20))

    def best(fn) -> float:
        times = []
        for _ in range(3):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return min(times) * 1000

    def read() -> None:
        with open(file, "rb") as f:
            while f.read(8 << 20):
                pass

    def crc() -> None:
        value = 0
        with open(file, "rb") as f:
            while block := f.read(8 << 20):
                value = zlib.crc32(block, value)

    def fresh_record() -> float:                # just written, as a save records it: the fsync writes it back
        data = os.urandom(mib << 20)
        times = []
        for _ in range(3):
            file.write_bytes(data)
            t = time.perf_counter()
            checkpoints.record(file)
            times.append(time.perf_counter() - t)
        return min(times) * 1000

    def write_only() -> float:
        data = os.urandom(mib << 20)
        times = []
        for _ in range(3):
            t = time.perf_counter()
            file.write_bytes(data)
            times.append(time.perf_counter() - t)
        return min(times) * 1000

    out = (f"checksum of a {mib} MiB file (page cache): read alone {best(read):.0f} ms, {checkpoints.HASH} "
           f"{best(lambda: checkpoints.hash_file(file, checkpoints.HASH)):.0f} ms, zlib.crc32 {best(crc):.0f} ms; a save writes "
           f"it in {write_only():.0f} ms, then hashes and flushes it (checkpoints.record) in {fresh_record():.0f} ms")
    file.unlink()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kills", type=int, default=60)
    ap.add_argument("--random-share", type=float, default=0.3, help="share of kills sent from outside at random")
    ap.add_argument("--max-steps", type=int, default=24)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dir", help="where R and the reference go (default: a temporary folder)")
    ap.add_argument("--disk", action="store_true", help="optimizer_offload disk: checkpoints link the tier's files")
    ap.add_argument("--model", default="llama-tiny")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    torch.set_num_threads(1)            # OpenMP's pool does not survive fork; one thread computes alike everywhere
    root = Path(args.dir or tempfile.mkdtemp(prefix="sltune-soak-"))
    root.mkdir(parents=True, exist_ok=True)
    soak, ref = root / "R", root / "reference"
    for p in (soak, ref):
        shutil.rmtree(p, ignore_errors=True)

    def config(tag: str) -> SpeedLoaderConfig:
        extra = {"optimizer_offload": "disk", "offload_dir": str(root / f"offload-{tag}")} if args.disk else {}
        return SpeedLoaderConfig(sub_batch_size=1, num_sub_batches=1, num_live_blocks=1, **extra)

    def job(steps: int, **kw) -> TrainJob:
        return TrainJob(model=args.model, config=config("soak"), seq_len=16, steps=steps, save=str(soak),
                        save_dtype="bfloat16", **kw)

    t0 = time.perf_counter()
    log = root / "reference.jsonl"
    log.unlink(missing_ok=True)
    run(TrainJob(model=args.model, config=config("ref"), seq_len=16, steps=args.max_steps, save=str(ref),
                 save_every=1, keep=args.max_steps, save_dtype="bfloat16", log=str(log)))
    losses = {s["step"]: s["loss"] for s in map(json.loads, log.read_text().splitlines())}
    reference = {int(p.name.split("-")[1]): exact_weights(p) for p in ref.glob("checkpoint-*")}
    reference[args.max_steps] = exact_weights(ref)
    print(f"reference: {args.max_steps} steps in {time.perf_counter() - t0:.1f}s", flush=True)

    points = [(p, n) for n in (1, 2) for p in checkpoints.CRASH_POINTS]
    counts = dict(kills=0, hook_kills=0, random_kills=0, segments=0, resumes=0, completed=0, not_reached=0,
                  mismatches=0, lost=0, incomplete_visible=0, errors=0, skipped_warnings=0,
                  rolled_forward=0)
    problems: list[str] = []
    newest = 0                       # the newest complete checkpoint's step before each segment
    at_point, misses = 0, 0          # the next named point, and the segments that ran past it unkilled
    segment = 0

    def check(after: str) -> int:
        """Verify what a run sees in R (after it finishes a dead run's complete save, as every run and resume does
        first); returns the newest complete step (0 when none)."""
        if soak.is_dir():
            if any((p / "training_state" / "manifest.json").is_file() for p in soak.glob(".sltune-*")):
                counts["rolled_forward"] += 1
            checkpoints.recover(soak)
        for folder in [*( [soak] if (soak / "training_state").exists() else []), *soak.glob("checkpoint-*")]:
            try:
                checkpoints.verify(folder)
            except checkpoints.Incomplete as err:
                counts["incomplete_visible"] += 1
                problems.append(f"{after}: visible and incomplete: {err}")
        warned: list[str] = []
        try:
            folder, trainer = checkpoints.latest(soak, warn=warned.append) if soak.is_dir() else (None, None)
        except ValueError as err:
            folder, trainer = None, None
            if newest:
                problems.append(f"{after}: nothing to resume: {err}")
        counts["skipped_warnings"] += len(warned)
        step = int(trainer["step"]) if trainer else 0
        if step < newest:
            counts["lost"] += 1
            problems.append(f"{after}: newest complete checkpoint went from step {newest} to {step}")
        if folder is not None:
            got, want = exact_weights(folder), reference[step]
            if got.keys() != want.keys() or not all(torch.equal(got[k], want[k]) for k in want):
                counts["mismatches"] += 1
                problems.append(f"{after}: {folder} (step {step}) holds other weights than the reference's")
        return step

    while counts["kills"] < args.kills:
        segment += 1
        fresh = newest >= args.max_steps or newest == 0
        target = args.max_steps if newest >= args.max_steps - 2 else min(args.max_steps, newest + rng.randint(2, 6))
        if fresh:
            target = rng.randint(3, 8)
        seg_job = job(target, save_every=rng.randint(1, 3), keep=rng.randint(1, 3),
                      resume=None if fresh else str(soak), overwrite=fresh,
                      log=str(root / f"segment-{segment}.jsonl"))
        outside = rng.random() < args.random_share
        crash = None
        if not outside:
            point, nth = points[at_point % len(points)]
            crash = f"{point}@{nth}"
        counts["segments"] += 1
        counts["resumes"] += 0 if fresh else 1
        pid = os.fork()
        if pid == 0:                                     # the segment
            code = 0
            try:
                torch.set_num_threads(1)
                if crash:
                    os.environ[checkpoints.CRASH_ENV] = crash
                run(seg_job)
            except BaseException as err:   # noqa: BLE001
                print(f"segment {segment}: {type(err).__name__}: {err}", file=sys.stderr, flush=True)
                code = 3
            os._exit(code)
        if outside:
            time.sleep(rng.uniform(0.0, 0.03 * (target - (0 if fresh else newest)) + 0.05))
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        _, status = os.waitpid(pid, 0)
        killed = os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
        how = f"{'random' if outside else crash} ({'fresh' if fresh else f'from {newest}'} to {target}, " \
              f"every {seg_job.save_every} keep {seg_job.keep})"
        if killed:
            counts["kills"] += 1
            counts["random_kills" if outside else "hook_kills"] += 1
            if crash:
                at_point, misses = at_point + 1, 0
        elif os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0:
            counts["completed"] += 1
            if crash:                       # a point this segment never reached (no rotation, no old folder...)
                counts["not_reached"] += 1
                misses += 1
                if misses == 3:             # three segments past it: on to the next point
                    at_point, misses = at_point + 1, 0
        else:
            counts["errors"] += 1
            problems.append(f"segment {segment} {how}: exit status {status}")
        logged = root / f"segment-{segment}.jsonl"
        if logged.is_file():
            for line in logged.read_text().splitlines():
                try:
                    s = json.loads(line)
                except ValueError:
                    continue                 # the line a kill cut
                if s["loss"] != losses[s["step"]]:
                    counts["mismatches"] += 1
                    problems.append(f"segment {segment} {how}: step {s['step']} loss {s['loss']} != "
                                    f"{losses[s['step']]}")
        if fresh:
            newest = 0                       # --overwrite: the old run's checkpoints are gone on purpose
        newest = check(f"segment {segment} {how}")
        print(f"segment {segment:3d}: {'killed' if killed else 'done  '} {how}: newest complete step {newest}",
              flush=True)

    final = job(args.max_steps, resume=str(soak) if newest else None, overwrite=not newest,
                log=str(root / "final.jsonl"))
    if newest < args.max_steps:
        run(final)
        counts["resumes"] += 1
        for s in map(json.loads, (root / "final.jsonl").read_text().splitlines()):
            if s["loss"] != losses[s["step"]]:
                counts["mismatches"] += 1
                problems.append(f"final run: step {s['step']} loss differs")
    if check("final run") != args.max_steps:
        problems.append("the final run did not end at --max-steps")

    for line in problems:
        print("PROBLEM:", line)
    print(f"kills {counts['kills']} ({counts['hook_kills']} at named points, "
          f"{counts['random_kills']} at random moments from outside); segments {counts['segments']} "
          f"({counts['completed']} ran to the end, {counts['not_reached']} of them past the point they were to be "
          f"killed at); resumes {counts['resumes']}; mismatches against the uninterrupted run {counts['mismatches']}; "
          f"checkpoints lost {counts['lost']}; visible incomplete checkpoints {counts['incomplete_visible']}; "
          f"complete saves a kill left aside and the next run moved in {counts['rolled_forward']}; "
          f"newer checkpoints skipped with a warning {counts['skipped_warnings']}; errors {counts['errors']}; "
          f"{time.perf_counter() - t0:.0f}s")
    print(checksum_cost(root))
    if not args.dir:
        shutil.rmtree(root, ignore_errors=True)
    bad = counts["mismatches"] + counts["lost"] + counts["incomplete_visible"] + counts["errors"] + len(problems)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
