"""Where Optuna keeps a job's study: beside sltune's tables, never among them. Optuna's generically named
tables (studies, trials, version_info, alembic_version) go to a PostgreSQL schema of their own, or to a
SQLite file next to the job store's, so neither tool can collide with the other."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sqlalchemy import make_url

from sltune.store.db import normalize_url

SCHEMA = "optuna"      # created (and 0.1's Optuna tables moved into it) by migration 0003


def optuna_location(url: str) -> tuple[str, dict[str, Any]]:
    """Optuna's storage URL and engine arguments for the job store at `url`."""
    url = normalize_url(url)
    if url.startswith("sqlite"):
        parsed = make_url(url)
        path = parsed.database
        if path and path != ":memory:":
            p = Path(path)
            url = parsed.set(database=str(p.with_name(f"{p.stem}-optuna{p.suffix}"))).render_as_string(False)
        return url, {"connect_args": {"timeout": 30}}
    return url, {"pool_pre_ping": True, "connect_args": {"options": f"-csearch_path={SCHEMA}"}}
