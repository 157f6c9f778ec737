"""/healthz's answer: the database, the live workers and the free space, checked off the event loop.

A thread of its own probes every `health_interval_s` and keeps the latest answer, so /healthz costs the
server one dictionary lookup: it never waits for a database connection, a thread of the API's pool or the
event loop's backlog, whatever storm of requests is being served meanwhile. The answer is 503 when the
database is unreachable, fewer workers are alive than `healthz_min_workers`, the data directory has less
free space than `min_free_bytes`, or the probe itself has not come back for a while (a database that hangs).
"""

from __future__ import annotations

import asyncio
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from sqlalchemy import text

from sltune import __version__
from sltune.settings import Settings
from sltune.sizes import format_bytes
from sltune.store import Store
from sltune.store.faults import describe


class HealthWatch:
    def __init__(self, store: Store, settings: Settings):
        self.store = store
        self.settings = settings
        self.min_workers = settings.healthz_min_workers or 0     # `sltune serve` sets it by its --no-worker
        self.latest: dict[str, Any] | None = None
        self.checked = 0.0
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="healthz")
        self._task: asyncio.Task | None = None
        self._lock = threading.Lock()

    def probe(self) -> dict[str, Any]:
        """One look at everything /healthz reports (blocking: runs in the watch's own thread)."""
        problems = []
        workers = None
        try:
            with self.store.Session() as s:
                s.execute(text("SELECT 1"))
            database = "ok"
            workers = len(self.store.live_workers(within_s=self.settings.alive_within_s))
        except Exception as err:  # noqa: BLE001 - reported, not raised
            database = f"unreachable: {describe(err)}"
            problems.append(f"the database is unreachable ({type(err).__name__}); jobs cannot be stored or run")
        try:
            free = shutil.disk_usage(self.settings.data_dir if self.settings.data_dir.exists() else ".").free
        except OSError:
            free = None
        if workers is not None and workers < self.min_workers:
            problems.append(f"{workers} live worker(s), fewer than the {self.min_workers} this server needs "
                            "(SLTUNE_HEALTHZ_MIN_WORKERS): queued jobs do not run; start one with `sltune worker`")
        if free is not None and free < self.settings.min_free_bytes:
            problems.append(f"{format_bytes(free)} free in the data directory, below SLTUNE_MIN_FREE_BYTES "
                            f"({format_bytes(self.settings.min_free_bytes)}): free space there")
        with self._lock:
            self.latest = {"status": "unavailable" if problems else "ok", "database": database, "workers": workers,
                           "free_bytes": free, "problems": problems, "version": __version__}
            self.checked = time.monotonic()
            return self.latest

    def answer(self) -> tuple[int, dict[str, Any]]:
        """(HTTP status, body) from the latest probe."""
        with self._lock:
            latest, age = self.latest, time.monotonic() - self.checked
        if latest is None:
            return 503, {"status": "unavailable", "database": "unknown", "workers": None, "free_bytes": None,
                         "problems": ["starting: not checked yet"], "version": __version__}
        limit = max(5.0, 5 * self.settings.health_interval_s)
        if age > limit:
            latest = {**latest, "status": "unavailable",
                      "problems": [*latest["problems"], f"the last health check finished {age:.0f}s ago; the "
                                                        "database may be hanging"]}
        return (503 if latest["status"] != "ok" else 200), latest

    async def start(self) -> None:
        """The first probe (so the server's first answer is a real one), then one every health_interval_s."""
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._executor, self.probe)

        async def watch() -> None:
            while True:
                await asyncio.sleep(self.settings.health_interval_s)
                await loop.run_in_executor(self._executor, self.probe)

        self._task = asyncio.create_task(watch())

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        self._executor.shutdown(wait=False, cancel_futures=True)
