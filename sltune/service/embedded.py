"""`sltune serve`'s own job worker: a process beside the API that dies with it (kill -9 included), and that
`serve` restarts when it exits, or, when it keeps exiting, stops for (exiting non-zero) rather than go on
accepting jobs nothing will run."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Iterator

from sltune.settings import Settings

log = logging.getLogger("sltune.api")
RESTART_WINDOW_S = 600.0


class EmbeddedWorker:
    """The worker process, and a thread that restarts it when it exits (after 1 s, then 2, 4, ... 30 s);
    more than `settings.embedded_worker_restarts` restarts within RESTART_WINDOW_S and `serve` is stopped
    (SIGTERM to itself), with `gave_up` saying why."""

    def __init__(self, settings: Settings):
        self.settings = settings
        self.proc: subprocess.Popen | None = None
        self.gave_up: str | None = None
        self.restarts: list[float] = []
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._watch = threading.Thread(target=self._watch_loop, name="embedded-worker", daemon=True)

    def start(self) -> None:
        self._spawn()
        self._watch.start()

    def _spawn(self) -> None:
        with self._lock:
            if self._stopping.is_set():
                return
            self.proc = subprocess.Popen([sys.executable, "-m", "sltune", "worker", "--db", self.settings.db_url(),
                                          "--data-dir", str(self.settings.data_dir), "--exit-with-parent"])
        log.info("embedded worker pid %d", self.proc.pid)

    def _watch_loop(self) -> None:
        while not self._stopping.is_set():
            code = self.proc.wait()
            if self._stopping.is_set():
                return
            now = time.monotonic()
            self.restarts = [t for t in self.restarts if now - t < RESTART_WINDOW_S]
            if len(self.restarts) >= self.settings.embedded_worker_restarts:
                self.gave_up = (f"its embedded worker exited (code {code}) {len(self.restarts) + 1} times within "
                                f"{RESTART_WINDOW_S / 60:.0f} minutes (SLTUNE_EMBEDDED_WORKER_RESTARTS="
                                f"{self.settings.embedded_worker_restarts}); see the worker's lines in this log")
                log.error("sltune serve stops: %s", self.gave_up)
                os.kill(os.getpid(), signal.SIGTERM)         # uvicorn shuts down; serve then exits non-zero
                return
            delay = min(30.0, 2.0 ** len(self.restarts))
            log.error("embedded worker pid %d exited with code %s; restarting it in %.0fs", self.proc.pid, code, delay)
            self.restarts.append(now)
            if self._stopping.wait(delay):
                return
            self._spawn()

    def stop(self) -> None:
        with self._lock:
            self._stopping.set()
        if self.proc is None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


@contextlib.contextmanager
def job_worker(settings: Settings) -> Iterator[EmbeddedWorker]:
    """A worker process on the server's database for the duration of the block, restarted when it exits.
    Started before the API imports its app, it imports torch on the other core meanwhile."""
    worker = EmbeddedWorker(settings)
    worker.start()
    try:
        yield worker
    finally:
        worker.stop()
