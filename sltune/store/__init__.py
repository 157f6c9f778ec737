"""Jobs, trials, fitted models and artifacts in SQLAlchemy: SQLite by default, PostgreSQL to scale out."""

from sltune.store.db import engine_for, normalize_url
from sltune.store.repo import Store
from sltune.store.schema import SCHEMA_VERSION, Artifact, Fit, Job, Trial, Worker

__all__ = ["SCHEMA_VERSION", "Artifact", "Fit", "Job", "Store", "Trial", "Worker", "engine_for", "normalize_url"]
