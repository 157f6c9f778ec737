"""The FastAPI application: REST routes, the dashboard pages, and (for `sltune serve`) one worker
process beside the server."""

from __future__ import annotations

import contextlib
import logging
import subprocess
import sys
from typing import AsyncIterator

from fastapi import FastAPI

from sltune import __version__
from sltune.api.limits import BodyLimit
from sltune.api.routes import router
from sltune.dashboards.pages import router as dashboard_router
from sltune.settings import Settings
from sltune.store import Store

log = logging.getLogger("sltune.api")


def create_app(settings: Settings | None = None, embedded_worker: bool = False) -> FastAPI:
    # spec validation builds models on the meta device from request threads; transformers' lazy imports
    # are not thread-safe, so load them once here
    import sltune.profiling.preload  # noqa: F401

    settings = settings or Settings()
    url = settings.db_url()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        worker = None
        if embedded_worker:
            worker = subprocess.Popen([sys.executable, "-m", "sltune", "worker", "--db", url,
                                       "--data-dir", str(settings.data_dir)])
            log.info("embedded worker pid %d", worker.pid)
        try:
            yield
        finally:
            if worker is not None:
                worker.terminate()
                try:
                    worker.wait(30)
                except subprocess.TimeoutExpired:
                    worker.kill()

    app = FastAPI(title="sltune", version=__version__, lifespan=lifespan,
                  description="SpeedLoader tuning service: POST /tune queues a job; workers run it; "
                              "GET /jobs/{id}/config.yaml hands the best config to training.")
    app.state.settings = settings
    app.state.store = Store(url)

    app.add_middleware(BodyLimit, limit=settings.max_request_bytes)
    app.include_router(router)
    app.include_router(dashboard_router)
    return app
