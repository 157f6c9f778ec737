"""One tuning job's wall time with its trials one at a time and two at once (hardware.parallel_trials 1 and 2), on a
simulated two-node Ray cluster on this machine, interleaved; and the arithmetic for a fleet of identical nodes.

    python bench/scale.py [--rounds 3] [--strategy grid] [--model llama-small] [--seq-len 32] [--trial-time 1]
                          [--cpus-per-node 1] [--sub-batch-sizes 1,2,4] [--num-sub-batches 1,2,4]

The cluster (ray.cluster_utils.Cluster): a head that runs nothing and two worker nodes of --cpus-per-node CPUs each
(on 2 cores, 1 each: two trials side by side get a core each, as two nodes would give them a machine each). Each trial
computes with hardware.cpu_threads = --cpus-per-node, in both jobs: the same configs measured the same way, one job
running them one at a time, the other two at once. Each round runs both jobs, in alternating order (A B, then B A),
each in its own SQLite database, no confirmation round (it runs one trial at a time on one node in either job: its
time is the same). Printed per round: each job's wall time, its trials, the sum of its trials' own times; then the
ratio (parallel 1 / parallel 2) per round as median [min, max].

The fleet: a job's trials of independent choice (the grid's; oneshot's probes) spread over P identical nodes take
about ceil(n / P) trials' time instead of n; what depends on earlier results (oneshot after its probes, the
confirmation round) runs one at a time whatever P. Printed from the measured trial times: the wall time the grid
would take on P = 1, 2, 4, 8 nodes (the parallel_trials 1 job's trials replayed in its order, each on the node that
frees first, plus that job's time outside its trials), beside the measured P = 1 and 2. The last line is one JSON
object with every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from sltune.loopback import free_port  # noqa: E402
from sltune.service.local import tune  # noqa: E402
from sltune.settings import Settings  # noqa: E402
from sltune.store import Store  # noqa: E402


def spec(args: argparse.Namespace, parallel: int) -> dict:
    ints = lambda text: [int(v) for v in text.split(",")]  # noqa: E731
    return {"name": f"scale-p{parallel}", "model": {"preset": args.model}, "workload": {"seq_len": args.seq_len},
            "hardware": {"executor": "ray", "parallel_trials": parallel, "cpu_threads": args.cpus_per_node},
            "search": {"strategy": args.strategy, "sub_batch_size": ints(args.sub_batch_sizes),
                       "num_sub_batches": ints(args.num_sub_batches), "num_live_blocks": [1],
                       "trial_steps": 2, "trial_min_time_s": args.trial_time, "confirm_rounds": 0,
                       "max_trials": 64}}


def run(args: argparse.Namespace, address: str, parallel: int, folder: Path) -> dict:
    db = f"sqlite:///{folder / f'p{parallel}-{time.monotonic_ns()}.db'}"
    t0 = time.monotonic()
    result = tune(spec(args, parallel), db, settings=Settings(data_dir=folder / "data", ray_address=address))
    wall = time.monotonic() - t0
    rows = Store(db).trials(result["job_id"])
    own = [(t.finished_at - t.started_at).total_seconds()
           for t in sorted(rows, key=lambda t: t.number) if t.started_at and t.finished_at]
    nodes = sorted({t["nodes"][0].split("/")[1] for t in result["trials"] if t.get("nodes")})
    return {"parallel": parallel, "wall_s": round(wall, 1), "trials": len(result["trials"]),
            "ok": sum(t["status"] == "ok" for t in result["trials"]), "trial_s_sum": round(sum(own), 1),
            "trial_s": [round(x, 2) for x in own],
            "trial_s_median": round(statistics.median(own), 2) if own else None, "nodes": nodes,
            "status": result["status"]}


def makespan(seconds: list[float], nodes: int) -> float:
    """The trials, in the job's order, each on the node that frees first: their wall time on `nodes` nodes."""
    free = [0.0] * nodes
    for s in seconds:
        free[free.index(min(free))] += s
    return max(free)


def spread(xs: list[float]) -> str:
    return f"{statistics.median(xs):.2f} [{min(xs):.2f}, {max(xs):.2f}]"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--strategy", default="grid")
    ap.add_argument("--model", default="llama-small")
    ap.add_argument("--seq-len", type=int, default=32)
    ap.add_argument("--trial-time", type=float, default=1.0)
    ap.add_argument("--cpus-per-node", type=int, default=1)
    ap.add_argument("--sub-batch-sizes", default="1,2,4")
    ap.add_argument("--num-sub-batches", default="1,2,4")
    args = ap.parse_args()

    import ray
    from ray.cluster_utils import Cluster

    os.environ["RAY_worker_niceness"] = "0"        # trials at the default priority (docs/guides/ray.md)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False,
                                                            "gcs_server_port": free_port()})
    for _ in range(2):
        cluster.add_node(num_cpus=args.cpus_per_node, include_dashboard=False)
    cluster.wait_for_nodes()
    rounds = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for r in range(args.rounds):
                order = (1, 2) if r % 2 == 0 else (2, 1)
                got = {}
                for p in order:
                    got[p] = run(args, cluster.address, p, Path(tmp))
                    print(f"round {r + 1}: parallel_trials {p}: {got[p]}", flush=True)
                rounds.append(got)
    finally:
        ray.shutdown()
        cluster.shutdown()

    ratio = [g[1]["wall_s"] / g[2]["wall_s"] for g in rounds]
    walls = {p: [g[p]["wall_s"] for g in rounds] for p in (1, 2)}
    trials = rounds[0][1]["trials"]
    trial_s = statistics.median(g[1]["trial_s_median"] for g in rounds)
    overhead = statistics.median(g[1]["wall_s"] - g[1]["trial_s_sum"] for g in rounds)
    # each round's own trial times (one at a time, the job's order) replayed over P nodes, plus the job's time
    # outside its trials; the median over rounds
    fleet = {p: round(statistics.median(g[1]["wall_s"] - g[1]["trial_s_sum"] + makespan(g[1]["trial_s"], p)
                                        for g in rounds), 1) for p in (1, 2, 4, 8)}
    print(f"\n{trials} trials a job ({args.strategy}, {args.model}, seq {args.seq_len}, "
          f"{args.cpus_per_node} CPU a node)")
    print(f"wall time, parallel_trials 1: {spread(walls[1])} s; 2: {spread(walls[2])} s")
    print(f"ratio (1 / 2), per round: {spread(ratio)}")
    print(f"a trial's own time (parallel 1): median {trial_s:.2f} s; the job's time outside its trials: "
          f"{overhead:.1f} s")
    print("on P identical nodes (the trials one at a time replayed, each on the node that frees first): "
          + ", ".join(f"P={p}: {s} s" for p, s in fleet.items()))
    print(json.dumps({"rounds": rounds, "ratio": ratio, "walls": walls, "trial_s": trial_s, "overhead_s": overhead,
                      "fleet_s": fleet}))


if __name__ == "__main__":
    main()
