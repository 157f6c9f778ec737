"""API throughput while a tuning job runs: status reads per second and POST /tune latency.

    python bench/api.py [--seconds 20] [--threads 4] [--posts 50]

Starts `sltune serve` (API + embedded worker, SQLite) on a free loopback port, submits a job that keeps
the worker busy, then measures, against that live server: GET /jobs/{id} reads per second from several
client threads, and the latency of POST /tune (p50/p99). Everything stays on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import httpx

TOKEN = "bench-token"


def spec(name: str, trials: int) -> dict:
    return {"name": name, "model": {"preset": "llama-tiny"}, "workload": {"seq_len": 64},
            "search": {"strategy": "grid", "max_trials": trials, "trial_steps": 20, "profile": True}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--posts", type=int, default=50)
    args = ap.parse_args()

    tmp = tempfile.mkdtemp(prefix="sltune-bench-")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "SLTUNE_API_TOKEN": TOKEN, "SLTUNE_DATA_DIR": tmp}
    server = subprocess.Popen([sys.executable, "-m", "sltune", "serve", "--port", str(port)], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    headers = {"Authorization": f"Bearer {TOKEN}"}
    try:
        for _ in range(120):
            try:
                if httpx.get(url + "/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.25)
        client = httpx.Client(base_url=url, headers=headers, timeout=30)
        job = client.post("/tune", json=spec("busy", 30)).json()["job_id"]
        while client.get(f"/jobs/{job}").json()["status"] != "running":
            time.sleep(0.2)
        print(f"server {url}; job {job} running (trials in a child process of the embedded worker)")

        counts = [0] * args.threads
        stop = time.monotonic() + args.seconds

        def reader(i: int) -> None:
            with httpx.Client(base_url=url, timeout=30) as c:
                while time.monotonic() < stop:
                    assert c.get(f"/jobs/{job}").status_code == 200
                    counts[i] += 1

        threads = [threading.Thread(target=reader, args=(i,)) for i in range(args.threads)]
        t0 = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        elapsed = time.monotonic() - t0
        print(f"GET /jobs/{{id}}: {sum(counts) / elapsed:,.1f} reads/s from {args.threads} threads "
              f"over {elapsed:.1f}s")

        lat = []
        for i in range(args.posts):
            t = time.perf_counter()
            r = client.post("/tune", json=spec(f"post-{i}", 1))
            lat.append(time.perf_counter() - t)
            assert r.status_code == 202, r.text
        lat.sort()
        p99 = lat[min(len(lat) - 1, int(round(0.99 * (len(lat) - 1))))]
        print(f"POST /tune: p50 {statistics.median(lat) * 1e3:.1f} ms, p99 {p99 * 1e3:.1f} ms "
              f"over {len(lat)} requests (spec validated, job queued)")
        status = client.get(f"/jobs/{job}").json()
        print(f"the busy job meanwhile: {status['status']}, {status['progress'].get('trials_done')} trials done")
        client.post(f"/jobs/{job}/cancel")
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(30)


if __name__ == "__main__":
    main()
