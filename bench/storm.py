"""/healthz latency while a storm of large POST /tune bodies arrives at once.

    python bench/storm.py [--posts 200] [--kb 200] [--rounds 1] [--max-trials 2] [--nice 0] [--db URL]
                          [--url URL --token T] [--json]

Starts `sltune serve --no-worker` on a free loopback port (or, with --url, measures a server already running),
then, per round: a prober process of its own asks GET /healthz every 20 ms while this process sends --posts
concurrent POST /tune, each a distinct spec of about --kb KB (an inline config whose id2label fills it, as a
classification head's config does), every one on its own connection. The prober is open loop: a request
goes out every 20 ms whatever the previous ones are doing, so a stall shows in every request it delays.
Prints /healthz p50/p99/max over the storm (requests sent from when the first POST is sent until the last
is answered), the POSTs' answers by status and their p50/p99, and the wall time; --json prints a list of
one JSON object per round. Client, prober and server share the machine: on a 2-core box the client's own
CPU use (encoding and sending 40 MB) is in the figures too.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter

import httpx

TOKEN = "bench-token"


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))] if values else float("nan")


def body(i: int, kb: int, max_trials: int = 2) -> bytes:
    """A distinct spec of about `kb` KB: a small llama whose config carries a big id2label map."""
    config = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128,
              "num_attention_heads": 4, "vocab_size": 512, "id2label": {}}
    spec = {"name": f"storm-{i}", "model": {"hf_config": config}, "workload": {"seq_len": 32},
            "search": {"sub_batch_size": [1, 2], "num_sub_batches": [1, 2], "num_live_blocks": [1],
                       "max_trials": max_trials, "trial_steps": 1, "trial_min_time_s": 0, "confirm_rounds": 0,
                       "profile": False, "seed": i}}
    base = len(json.dumps(spec))
    entry = len(json.dumps({"1000": f"LABEL_{i:04d}_{1000:08d}"})) - 1      # '"k": "v", ' as the map holds it
    config["id2label"] = {str(k): f"LABEL_{i:04d}_{k:08d}" for k in range(max(0, (kb * 1000 - base) // entry))}
    return json.dumps(spec).encode()


def probe(url: str, stop, out) -> None:
    """The prober (its own process): GET /healthz every 20 ms, open loop: each request goes out on schedule
    whether or not the previous ones have been answered, so a stall of the server shows in every request that
    arrives during it (not only in the one that was waiting: "coordinated omission"). Sends back (start
    time, seconds, status) per request."""
    async def run() -> list:
        samples = []
        limits = httpx.Limits(max_connections=200, max_keepalive_connections=200)
        async with httpx.AsyncClient(base_url=url, timeout=10, limits=limits) as c:
            async def one() -> None:
                t0 = time.time()
                s0 = time.perf_counter()
                try:
                    status: object = (await c.get("/healthz")).status_code
                except httpx.HTTPError as err:
                    status = type(err).__name__
                samples.append((t0, time.perf_counter() - s0, status))

            tasks = []
            next_at = time.perf_counter()
            while not stop.is_set():
                tasks.append(asyncio.create_task(one()))
                next_at += 0.02
                await asyncio.sleep(max(0.0, next_at - time.perf_counter()))
            await asyncio.gather(*tasks)
        return samples

    out.send(asyncio.run(run()))


async def storm(url: str, token: str, bodies: list[bytes]) -> tuple[list[tuple[float, object]], float, float]:
    """Every body posted at once, each on a connection of its own; (seconds, status) per POST."""
    headers = {"Authorization": f"Bearer {token}", "content-type": "application/json"}
    limits = httpx.Limits(max_connections=len(bodies), max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=120, limits=limits) as c:
        async def one(b: bytes) -> tuple[float, object]:
            t0 = time.perf_counter()
            try:
                status: object = (await c.post("/tune", content=b)).status_code
            except httpx.HTTPError as err:
                status = type(err).__name__
            return time.perf_counter() - t0, status

        start = time.time()
        answers = await asyncio.gather(*(one(b) for b in bodies))
        return list(answers), start, time.time()


def round_(url: str, token: str, posts: int, kb: int, seed: int, max_trials: int = 2, nice: int = 0) -> dict:
    bodies = [body(seed * posts + i, kb, max_trials) for i in range(posts)]
    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    recv, send = ctx.Pipe(duplex=False)
    prober = ctx.Process(target=probe, args=(url, stop, send))
    prober.start()
    time.sleep(1.0)                 # the prober's imports and first requests, before the storm
    if nice:
        os.nice(nice)               # the sender yields the cores to the server (and the prober) from now on
    answers, start, end = asyncio.run(storm(url, token, bodies))
    time.sleep(0.2)
    stop.set()
    samples = recv.recv()
    prober.join(10)
    during = [s for t0, s, _ in samples if start <= t0 <= end]
    statuses = Counter(str(st) for t0, _, st in samples if start <= t0 <= end)
    post_lat = [s for s, _ in answers]
    return {"posts": posts, "kb": round(len(bodies[0]) / 1000), "wall_s": round(end - start, 2),
            "post_status": dict(Counter(str(st) for _, st in answers)),
            "post_p50_ms": round(statistics.median(post_lat) * 1e3, 1),
            "post_p99_ms": round(pct(post_lat, 0.99) * 1e3, 1),
            "healthz_n": len(during), "healthz_status": dict(statuses),
            "healthz_p50_ms": round(statistics.median(during) * 1e3, 1) if during else None,
            "healthz_p99_ms": round(pct(during, 0.99) * 1e3, 1) if during else None,
            "healthz_max_ms": round(max(during) * 1e3, 1) if during else None}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(db: str | None, tmp: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = {**os.environ, "SLTUNE_API_TOKEN": TOKEN, "SLTUNE_DATA_DIR": os.path.join(tmp, "data")}
    args = [sys.executable, "-m", "sltune", "serve", "--no-worker", "--port", str(port),
            "--db", db or f"sqlite:///{tmp}/jobs.db"]
    proc = subprocess.Popen(args, env=env, stdout=open(os.path.join(tmp, "serve.log"), "wb"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/healthz", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    proc.kill()
    raise SystemExit("the server did not come up; see " + os.path.join(tmp, "serve.log"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--posts", type=int, default=200, help="concurrent POST /tune per round")
    ap.add_argument("--kb", type=int, default=200, help="size of each body, KB")
    ap.add_argument("--rounds", type=int, default=1, help="storms, one after the other")
    ap.add_argument("--db", help="SQLAlchemy URL for the server this starts (default: SQLite in a temporary directory)")
    ap.add_argument("--url", help="measure this running server instead of starting one")
    ap.add_argument("--token", default=os.environ.get("SLTUNE_API_TOKEN", TOKEN), help="with --url: its token")
    ap.add_argument("--max-trials", type=int, default=2, help="each spec's search.max_trials (above the server's "
                    "SLTUNE_MAX_TRIALS: every spec is checked in full, then refused, and no job is queued)")
    ap.add_argument("--nice", type=int, default=0, help="lower this sender's priority by this much once the prober "
                    "runs (its first round): on a shared machine the sender, which stands for clients elsewhere, "
                    "then takes no cores from the server")
    ap.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="sltune-storm-") as tmp:
        proc = None
        url = args.url
        if url is None:
            proc, url = start_server(args.db, tmp)
        try:
            rounds = []
            for r in range(args.rounds):
                rounds.append(round_(url, args.token, args.posts, args.kb, seed=r + int(time.time()) % 100_000,
                                     max_trials=args.max_trials, nice=args.nice if r == 0 else 0))
                if not args.json:
                    x = rounds[-1]
                    print(f"round {r + 1}: {x['posts']} POSTs of {x['kb']} KB in {x['wall_s']} s {x['post_status']} "
                          f"(p50 {x['post_p50_ms']} ms, p99 {x['post_p99_ms']} ms); /healthz x{x['healthz_n']} "
                          f"{x['healthz_status']}: p50 {x['healthz_p50_ms']} ms, p99 {x['healthz_p99_ms']} ms, "
                          f"max {x['healthz_max_ms']} ms", flush=True)
                time.sleep(2)
            if args.json:
                print(json.dumps(rounds))
        finally:
            if proc is not None:
                proc.terminate()
                proc.wait(30)


if __name__ == "__main__":
    main()
