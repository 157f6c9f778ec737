"""A DeepSpeed trial's setup on a fresh machine against a warm one's (issue #46: a trial never compiles).

    python bench/deepspeed_setup.py [--rounds 3] [--python PATH] [--old-tree DIR]

Each round runs `sltune profile --backend deepspeed --offload-optimizer cpu` (CPU Adam and the shared-memory
all-reduce: the ops DeepSpeed compiles when its install left them out) twice in processes of their own:

- fresh: a new, empty torch extension cache (TORCH_EXTENSIONS_DIR), as on a machine that never loaded the ops;
- warm: the same cache again, the ops already built.

It reports each's trial setup (TrialResult.timing.setup_s: fork to first step) and the command's whole wall time,
medians with min and max, and the ratio fresh / warm of the setup. With a DeepSpeed installed with its ops built
(`bash scripts/install.sh backends`) both load them prebuilt; with one installed without them (--python of such a
venv), the fresh run builds them before its trial (sltune.backends.deepspeed_ops), so its trial's setup stays
near the warm one's and the build shows in the wall time only. `--old-tree DIR` runs the fresh case with the
sltune of another checkout too (PYTHONPATH=DIR), e.g. the commit before the fix, whose trial compiled inside.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

COMMAND = ["-m", "sltune", "profile", "--backend", "deepspeed", "--offload-optimizer", "cpu", "--seq-len", "32",
           "--sub-batch-size", "1", "--num-sub-batches", "2", "--steps", "1", "--min-time", "0", "--no-profile",
           "--timeout", "900", "--json"]


def run(python: str, cache: str, tree: str | None = None) -> dict:
    """One profile: its setup_s, its status, the whole command's seconds."""
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": cache}
    if tree:
        env["PYTHONPATH"] = tree
    began = time.monotonic()
    # from a folder of its own: `python -m` puts the working directory first on sys.path, before PYTHONPATH
    done = subprocess.run([python, *COMMAND], capture_output=True, text=True, env=env, cwd=tempfile.gettempdir())
    wall = time.monotonic() - began
    try:
        r = json.loads(done.stdout)
    except ValueError:
        return {"status": f"exit {done.returncode}: {done.stderr.strip()[-300:]}", "setup_s": None, "wall_s": wall}
    return {"status": r["status"], "setup_s": (r.get("timing") or {}).get("setup_s"), "wall_s": wall,
            "optimizer": (r.get("backend_detail") or {}).get("optimizer"),
            "said": [line for line in done.stderr.splitlines() if line.startswith("sltune: ")]}


def spread(xs: list[float]) -> str:
    xs = [x for x in xs if x is not None]
    if not xs:
        return "-"
    return f"{statistics.median(xs):.2f} [{min(xs):.2f}, {max(xs):.2f}]"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--python", default=sys.executable, help="the interpreter of the venv to measure")
    ap.add_argument("--old-tree", help="a checkout whose sltune runs the fresh case too (PYTHONPATH)")
    args = ap.parse_args()
    rows: dict[str, list[dict]] = {"fresh": [], "warm": [], "old fresh": []}
    for k in range(args.rounds):
        with tempfile.TemporaryDirectory() as cache:
            rows["fresh"].append(run(args.python, cache))
            rows["warm"].append(run(args.python, cache))
        if args.old_tree:
            with tempfile.TemporaryDirectory() as cache:
                rows["old fresh"].append(run(args.python, cache, args.old_tree))
        print(f"round {k + 1}: " + "; ".join(f"{name} {r[-1]['status']} setup {r[-1]['setup_s']} wall "
                                             f"{r[-1]['wall_s']:.1f}" for name, r in rows.items() if r), flush=True)
    for name, rs in rows.items():
        if rs:
            print(f"{name:10s} setup_s {spread([r['setup_s'] for r in rs])}  wall_s {spread([r['wall_s'] for r in rs])}"
                  f"  optimizer {rs[0].get('optimizer')}  said {rs[0].get('said')}")
    ratios = [f["setup_s"] / w["setup_s"] for f, w in zip(rows["fresh"], rows["warm"]) if f["setup_s"] and w["setup_s"]]
    if ratios:
        print(f"fresh / warm trial setup: {spread(ratios)} (goal: at most 2)")


if __name__ == "__main__":
    main()
