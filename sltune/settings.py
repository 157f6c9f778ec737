"""Every setting of sltune in one place: environment variables (SLTUNE_*), overridable by CLI flags."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import psutil
from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from sltune.sizes import parse_bytes


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SLTUNE_", extra="ignore")

    data_dir: Path = Field(Path("sltune-data"), description="SQLite file, traces and other artifacts")
    db: str | None = Field(None, description="SQLAlchemy URL; default: a SQLite file in data_dir")
    api_token: str | None = Field(None, description="bearer token every write to the API needs")
    models_dir: Path | None = Field(None, description="the folder under which POST /tune may name Hugging Face "
                                    "model folders (model.path, relative to it or absolute inside it); unset: a "
                                    "spec naming model.path is refused, since the server reads no path a request "
                                    "names outside it")
    host: str = "127.0.0.1"
    port: int = 8000
    access_log: bool = Field(False, description="log every request (uvicorn's access log); off, it costs "
                                                "reads per second")
    api_workers: int = Field(1, ge=1, le=64, description="API server processes (uvicorn workers): reads scale "
                             "with cores; each process checks specs in its own pool")
    api_threads: int = Field(4, ge=1, le=64, description="threads that run the API's database work at once; more "
                             "only contend for the interpreter lock (requests beyond them wait their turn)")
    # ceilings on what one request may ask for: counts and times above them are refused, memory limits
    # above them are lowered to them (see sltune/service/ceilings.py)
    max_request_bytes: int = 256 * 1024
    max_trials: int = Field(200, ge=1)
    max_time_budget_s: float = Field(24 * 3600, gt=0)
    max_trial_timeout_s: float = Field(3600, gt=0)
    max_trial_steps: int = Field(1000, ge=1, description="timed steps one trial may run (search.trial_steps and "
                                 "search.trial_max_steps; a spec naming no trial_max_steps gets at most this)")
    max_confirm_rounds: int = Field(20, ge=0, description="ceiling on search.confirm_rounds; confirmation trials "
                                    "also count against max_trials with the search's")
    max_device_memory: int | None = Field(None, description="ceiling on a job's device_memory_limit (bytes or "
                                                             "e.g. '24GiB'); unset: what the worker's device has")
    max_tokens_per_step: int = Field(1 << 20, description="largest sub_batch_size*num_sub_batches*tokens a "
                                                            "request may ask a trial to run")
    max_world_size: int | None = Field(None, ge=1, le=1024, description="ceiling on hardware.world_size: a trial "
                                       "runs its ranks as processes on one worker's machine; unset: this machine's "
                                       "cores, the most its own worker runs (set it where workers have more)")
    spec_check_workers: int | None = Field(None, ge=1, le=16, description="processes that check POST /tune bodies "
                                           "at once, niced; unset: this machine's cores but one (at most 4), so a "
                                           "slow check (a 1,024-layer config takes seconds) leaves the others free "
                                           "where there are cores to spare, and the server always keeps one (on 2 "
                                           "cores, 2 checkers held /healthz for 327 ms beside a busy process)")
    spec_check_timeout_s: float = Field(30.0, gt=0, description="a spec whose check takes longer is refused")
    spec_check_queue: int = Field(32, ge=1, description="specs waiting to be checked before POST /tune "
                                                        "answers 503")
    trial_host_memory_fraction: float = Field(0.75, gt=0, le=1, description="ceiling on a trial's host memory, "
                                              "as a share of the machine's: jobs asking for more (or naming no "
                                              "host_memory_limit) get this")
    # workers
    ray_address: str | None = Field(None, description="host:port of the Ray cluster's head that jobs with "
                                    "hardware.executor ray run their trials on; unset: Ray's own RAY_ADDRESS")
    lease_seconds: float = 30.0
    heartbeat_seconds: float = 5.0
    poll_seconds: float = 1.0
    forget_workers_after_s: float = Field(600.0, gt=0, description="rows of workers silent this long are "
                                          "deleted (a live worker touches its row every few seconds)")
    jobs_per_worker: int = Field(1, ge=1, le=64, description="jobs one worker runs at once")
    db_retry_s: float | None = Field(None, ge=0, description="how long a worker retries a store call through a "
                                     "lost database connection (a restart, a failover) or a full disk before it "
                                     "hands the job back; unset: lease_seconds")
    embedded_worker_restarts: int = Field(5, ge=0, description="times `sltune serve` restarts its embedded worker "
                                          "within 10 minutes before it exits non-zero itself")
    # /healthz
    health_interval_s: float = Field(1.0, gt=0, le=60, description="how often /healthz's answer is refreshed "
                                     "(database, live workers, free space), off the event loop")
    healthz_min_workers: int | None = Field(None, ge=0, description="live workers below which /healthz answers "
                                            "503; unset: 1 for `sltune serve` with its embedded worker, 0 for "
                                            "--no-worker (its workers run elsewhere)")
    min_free_bytes: int = Field(256 * 2**20, ge=0, description="free space in data_dir (bytes or e.g. '256MiB') "
                                "below which /healthz answers 503: traces and a SQLite store need room")

    @property
    def alive_within_s(self) -> float:
        """How recently a worker must have touched its row to count as live: three polls, or a lease."""
        return max(3 * self.poll_seconds, self.lease_seconds)

    @property
    def spec_checkers(self) -> int:
        """The checker processes POST /tune runs (spec_check_workers, else the cores but one, 1 to 4)."""
        return self.spec_check_workers or max(1, min(4, (os.cpu_count() or 1) - 1))

    @property
    def world_size_ceiling(self) -> int:
        """The most ranks a request's trials may ask for (max_world_size, else this machine's cores)."""
        return self.max_world_size or max(1, os.cpu_count() or 1)

    @property
    def store_retry_s(self) -> float:
        """How long a worker's store calls retry through database failures (db_retry_s, else the lease)."""
        return self.lease_seconds if self.db_retry_s is None else self.db_retry_s

    @field_validator("api_token")
    @classmethod
    def _token(cls, value: str | None) -> str | None:
        """A blank token is no token: it must never match an empty Authorization header, nor let the
        server bind beyond loopback as if writes were protected. A trailing newline (a token read
        from a file) is not part of it."""
        return (value or "").strip() or None

    @field_validator("models_dir", mode="before")
    @classmethod
    def _models_dir(cls, value: Any) -> Any:
        """An empty SLTUNE_MODELS_DIR is unset, not the current directory."""
        return None if value is None or (isinstance(value, str) and not value.strip()) else value

    @field_validator("max_device_memory", "min_free_bytes", mode="before")
    @classmethod
    def _bytes(cls, value: Any, info) -> int | None:
        return None if value in (None, "") else parse_bytes(value, f"SLTUNE_{info.field_name.upper()}")

    def trial_host_limit(self) -> int:
        return int(psutil.virtual_memory().total * self.trial_host_memory_fraction)

    def trial_host_limit_source(self) -> str:
        """How a message names the ceiling a spec or trial without a host limit gets."""
        from sltune.sizes import format_bytes

        return (f"this machine's trial ceiling ({self.trial_host_memory_fraction:.0%} of its "
                f"{format_bytes(psutil.virtual_memory().total)}; SLTUNE_TRIAL_HOST_MEMORY_FRACTION)")

    def db_url(self) -> str:
        if self.db:
            return self.db
        self.data_dir.mkdir(parents=True, exist_ok=True)
        return f"sqlite:///{(self.data_dir / 'sltune.db').resolve()}"

    def artifact_dir(self) -> Path:
        path = self.data_dir / "artifacts"
        path.mkdir(parents=True, exist_ok=True)
        return path

    def offload_root(self) -> Path:
        """Where trials of optimizer_offload disk write their optimizer files: a folder per job and trial, each
        removed when its trial ends (never a path a spec names)."""
        return self.data_dir / "offload"
