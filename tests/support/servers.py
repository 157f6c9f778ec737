"""Real `sltune serve` and `sltune worker` processes, for the tests that need them as a user starts them: each in its
own session, so a kill takes its trials along (tests/conftest.py's `services` fixture builds on these)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

TOKEN = "test-token"
FAST_LEASES = {"SLTUNE_LEASE_SECONDS": "3", "SLTUNE_HEARTBEAT_SECONDS": "0.5", "SLTUNE_POLL_SECONDS": "0.2"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proc:
    """A subprocess in its own session, so a kill takes its trial children with it."""

    def __init__(self, args: list[str], env: dict[str, str], log: Path):
        self.log = log
        self._fh = open(log, "wb")
        self.p = subprocess.Popen([sys.executable, "-m", "sltune", *args], env=env, stdout=self._fh,
                                  stderr=subprocess.STDOUT, start_new_session=True)

    def kill(self, sig=signal.SIGKILL) -> None:
        try:
            os.killpg(self.p.pid, sig)
        except ProcessLookupError:
            pass
        try:
            self.p.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(self.p.pid, signal.SIGKILL)
            self.p.wait(10)
        self._fh.close()

    def output(self) -> str:
        return self.log.read_text(errors="replace")


class Services:
    """Starts `sltune serve` and `sltune worker` processes against one database; stops them all."""

    def __init__(self, tmp: Path, db: str):
        self.tmp, self.db = tmp, db
        self.env = {**os.environ, "SLTUNE_API_TOKEN": TOKEN, "SLTUNE_DATA_DIR": str(tmp / "data"), **FAST_LEASES}
        self.procs: list[Proc] = []
        self.url = None

    def serve(self, worker: bool = False, workers: int = 1) -> str:
        port = free_port()
        args = ["serve", "--port", str(port), "--db", self.db] + ([] if worker else ["--no-worker"])
        args += ["--workers", str(workers)] if workers > 1 else []
        self.procs.append(Proc(args, self.env, self.tmp / f"serve-{port}.log"))
        self.url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 150           # a loaded 2-core machine: every process imports torch
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/healthz", timeout=1).status_code == 200:
                    return self.url
            except httpx.HTTPError:
                time.sleep(0.2)
        raise RuntimeError("server did not come up:\n" + self.procs[-1].output())

    def worker(self) -> Proc:
        proc = Proc(["worker", "--db", self.db], self.env, self.tmp / f"worker-{len(self.procs)}.log")
        self.procs.append(proc)
        return proc

    def client(self, token: str | None = TOKEN) -> httpx.Client:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=30)

    def stop(self) -> None:
        for p in self.procs:
            p.kill(signal.SIGTERM)


def wait_for(client: httpx.Client, job_id: str, statuses=("succeeded", "failed", "cancelled"), timeout=240) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = client.get(f"/jobs/{job_id}").json()
        if job["status"] in statuses:
            return job
        time.sleep(0.3)
    raise AssertionError(f"job {job_id} did not reach {statuses}: {job}")
