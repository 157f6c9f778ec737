"""Every setting of sltune in one place: environment variables (SLTUNE_*), overridable by CLI flags."""

from __future__ import annotations

from pathlib import Path

import psutil
from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SLTUNE_", extra="ignore")

    data_dir: Path = Field(Path("sltune-data"), description="SQLite file, traces and other artifacts")
    db: str | None = Field(None, description="SQLAlchemy URL; default: a SQLite file in data_dir")
    api_token: str | None = Field(None, description="bearer token every write to the API needs")
    host: str = "127.0.0.1"
    port: int = 8000
    # bounds on what one request may ask for
    max_request_bytes: int = 256 * 1024
    max_trials: int = 200
    max_time_budget_s: float = 24 * 3600
    max_trial_timeout_s: float = 3600
    max_tokens_per_step: int = Field(1 << 20, description="largest sub_batch_size*num_sub_batches*tokens a "
                                                            "request may ask a trial to run")
    trial_host_memory_fraction: float = Field(0.75, gt=0, le=1, description="trials of service jobs without a "
                                              "host_memory_limit stop at this share of the machine's memory")
    # workers
    lease_seconds: float = 30.0
    heartbeat_seconds: float = 5.0
    poll_seconds: float = 1.0
    jobs_per_worker: int = Field(1, ge=1, le=64, description="jobs one worker runs at once")

    @field_validator("api_token")
    @classmethod
    def _token(cls, value: str | None) -> str | None:
        """An empty token is no token: it must never match an empty Authorization header."""
        return value or None

    def trial_host_limit(self) -> int:
        return int(psutil.virtual_memory().total * self.trial_host_memory_fraction)

    def db_url(self) -> str:
        if self.db:
            return self.db
        self.data_dir.mkdir(parents=True, exist_ok=True)
        return f"sqlite:///{(self.data_dir / 'sltune.db').resolve()}"

    def artifact_dir(self) -> Path:
        path = self.data_dir / "artifacts"
        path.mkdir(parents=True, exist_ok=True)
        return path
