"""`sltune serve`'s own job worker: a process beside the API that dies with it (kill -9 included)."""

from __future__ import annotations

import contextlib
import logging
import subprocess
import sys
from typing import Iterator

from sltune.settings import Settings

log = logging.getLogger("sltune.api")


@contextlib.contextmanager
def job_worker(settings: Settings) -> Iterator[None]:
    """A worker process on the server's database for the duration of the block. Started before the API
    imports its app, it imports torch on the other core meanwhile."""
    worker = subprocess.Popen([sys.executable, "-m", "sltune", "worker", "--db", settings.db_url(),
                               "--data-dir", str(settings.data_dir), "--exit-with-parent"])
    log.info("embedded worker pid %d", worker.pid)
    try:
        yield
    finally:
        worker.terminate()
        try:
            worker.wait(30)
        except subprocess.TimeoutExpired:
            worker.kill()
