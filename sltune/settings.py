"""Every setting of sltune in one place: environment variables (SLTUNE_*), overridable by CLI flags."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field
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
    # workers
    lease_seconds: float = 30.0
    heartbeat_seconds: float = 5.0
    poll_seconds: float = 1.0
    jobs_per_worker: int = 1

    def db_url(self) -> str:
        if self.db:
            return self.db
        self.data_dir.mkdir(parents=True, exist_ok=True)
        return f"sqlite:///{(self.data_dir / 'sltune.db').resolve()}"

    def artifact_dir(self) -> Path:
        path = self.data_dir / "artifacts"
        path.mkdir(parents=True, exist_ok=True)
        return path
