"""API throughput and latency with many jobs stored, over HTTP keep-alive.

    python bench/api.py [--jobs 400] [--seconds 10] [--clients 8] [--many 32] [--busy] [--db URL]
                        [--client httpx|wrk] [--server-workers N]

Starts `sltune serve` on a free loopback port (no worker, so queued jobs stay queued and only the API
is measured; --busy adds the embedded worker running a job, whose trials then compete for the cores),
fills the store with --jobs jobs through POST /tune (its latency is measured on those requests), then
measures, each for --seconds: GET /jobs/{id} and GET /jobs from --clients concurrent keep-alive
connections, and GET /jobs/{id} from --many. Prints reads/s, p50/p99 latency and the server's CPU time
per request (user + system, its child processes included), which a busy machine distorts far less than
the rates. Client and server share the machine: on a 2-core box the client's CPU use limits the rates.
The load comes from httpx (asyncio, in this process) or, with --client wrk, from wrk (Debian's `wrk`: a C
client that needs a tenth of httpx's CPU per request, so more of the box is left to the server; its
latency percentiles are wrk's own). --server-workers runs `sltune serve --workers N`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import httpx
import psutil

TOKEN = "bench-token"


def spec(name: str, trials: int = 1) -> dict:
    return {"name": name, "model": {"preset": "llama-tiny"}, "workload": {"seq_len": 64},
            "search": {"strategy": "grid", "max_trials": trials, "trial_steps": 20, "profile": True}}


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def describe(name: str, lat: list[float], cpu_s: float, seconds: float | None = None) -> str:
    rate = f"{len(lat) / seconds:8,.1f} req/s, " if seconds else ""
    return (f"{name:<40} {rate}p50 {statistics.median(lat) * 1e3:6.1f} ms, p99 {pct(lat, 0.99) * 1e3:6.1f} ms, "
            f"max {max(lat) * 1e3:6.1f} ms; server CPU {cpu_s / len(lat) * 1e3:.2f} ms/request ({len(lat)} requests)")


def cpu_seconds(pid: int) -> float:
    """User + system CPU of the server and its children so far: what a request costs, whatever else the
    machine is doing (on a shared machine, wall-clock rates mostly measure the neighbours)."""
    procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


async def load(url: str, paths: list[str], clients: int, seconds: float) -> tuple[list[float], float]:
    """`clients` connections, each sending its next request as soon as the last one is answered."""
    lat: list[float] = []
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=30) as c:
        stop = time.monotonic() + seconds

        async def one() -> None:
            while time.monotonic() < stop:
                t = time.perf_counter()
                r = await c.get(random.choice(paths))
                lat.append(time.perf_counter() - t)
                assert r.status_code == 200, r.text

        t0 = time.monotonic()
        await asyncio.gather(*(one() for _ in range(clients)))
        return lat, time.monotonic() - t0


WRK_SCRIPT = """
local paths = {%s}
request = function() return wrk.format("GET", paths[math.random(#paths)]) end
done = function(summary, latency, requests)
  io.write(string.format("WRK %%d %%d %%d %%d %%d\\n", summary.requests, summary.duration,
    latency:percentile(50), latency:percentile(99), latency.max))
  local errors = summary.errors.status + summary.errors.connect + summary.errors.read + summary.errors.write
  io.write(string.format("WRKERR %%d\\n", errors))
end
"""


def load_wrk(url: str, paths: list[str], clients: int, seconds: float, tmp: str) -> tuple[int, float, dict]:
    """wrk with `clients` keep-alive connections on one thread: requests, seconds and latency (s) p50/p99/max."""
    script = os.path.join(tmp, "paths.lua")
    with open(script, "w") as f:
        f.write(WRK_SCRIPT % ", ".join(f'"{p}"' for p in paths))
    out = subprocess.run(["wrk", "-t1", f"-c{clients}", f"-d{seconds:g}s", "-s", script, url],
                         capture_output=True, text=True, check=True).stdout
    fields = next(line for line in out.splitlines() if line.startswith("WRK ")).split()[1:]
    errors = int(next(line for line in out.splitlines() if line.startswith("WRKERR")).split()[1])
    assert errors == 0, out
    requests, micros, p50, p99, top = (int(x) for x in fields)
    return requests, micros / 1e6, {"p50": p50 / 1e6, "p99": p99 / 1e6, "max": top / 1e6}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--jobs", type=int, default=400)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--many", type=int, default=32)
    ap.add_argument("--busy", action="store_true", help="run a tuning job in the embedded worker meanwhile")
    ap.add_argument("--db", help="SQLAlchemy URL (default: SQLite in a temporary directory)")
    ap.add_argument("--client", choices=("httpx", "wrk"), default="httpx", help="the load generator")
    ap.add_argument("--server-workers", type=int, default=1, help="uvicorn worker processes of the server")
    args = ap.parse_args()

    tmp = tempfile.mkdtemp(prefix="sltune-bench-")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "SLTUNE_API_TOKEN": TOKEN, "SLTUNE_DATA_DIR": tmp}
    cmd = [sys.executable, "-m", "sltune", "serve", "--port", str(port)] + ([] if args.busy else ["--no-worker"])
    cmd += ["--db", args.db] if args.db else []
    cmd += ["--workers", str(args.server_workers)] if args.server_workers > 1 else []
    server = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(240):
            try:
                if httpx.get(url + "/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.25)
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30) as client:
            if args.busy:
                busy = client.post("/tune", json=spec("busy", 30)).json()["job_id"]
                while client.get(f"/jobs/{busy}").json()["status"] != "running":
                    time.sleep(0.2)
            posts, ids = [], []
            cpu0 = cpu_seconds(server.pid)
            for i in range(args.jobs):
                t = time.perf_counter()
                r = client.post("/tune", json=spec(f"job-{i}"))
                posts.append(time.perf_counter() - t)
                assert r.status_code == 202, r.text
                ids.append(r.json()["job_id"])
        print(f"server {url}, {'a job running' if args.busy else 'no worker'}, {len(ids)} jobs stored")
        print(describe("POST /tune (spec checked, queued)", posts, cpu_seconds(server.pid) - cpu0))
        one = [f"/jobs/{i}" for i in ids]
        for name, paths, clients in ((f"GET /jobs/{{id}}, {args.clients} clients", one, args.clients),
                                     (f"GET /jobs (100 of them), {args.clients} clients", ["/jobs"], args.clients),
                                     (f"GET /jobs/{{id}}, {args.many} clients", one, args.many)):
            cpu0 = cpu_seconds(server.pid)
            if args.client == "wrk":
                n, seconds, lat = load_wrk(url, paths, clients, args.seconds, tmp)
                cpu = cpu_seconds(server.pid) - cpu0
                print(f"{name:<40} {n / seconds:8,.1f} req/s, p50 {lat['p50'] * 1e3:6.1f} ms, p99 "
                      f"{lat['p99'] * 1e3:6.1f} ms, max {lat['max'] * 1e3:6.1f} ms; server CPU "
                      f"{cpu / n * 1e3:.2f} ms/request ({n} requests, wrk)")
                continue
            lat, seconds = asyncio.run(load(url, paths, clients, args.seconds))
            print(describe(name, lat, cpu_seconds(server.pid) - cpu0, seconds))
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(30)


if __name__ == "__main__":
    main()
