"""Opening a store by URL: SQLite (a file, WAL mode) by default, PostgreSQL to scale out."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from sqlalchemy import Engine, create_engine, event, make_url, select
from sqlalchemy.orm import Session, sessionmaker

from sltune.store.schema import SCHEMA_VERSION, Base, SchemaVersion


def normalize_url(url: str) -> str:
    """postgresql:// means psycopg 3 here (the driver sltune installs)."""
    if url.startswith("postgresql://") or url.startswith("postgres://"):
        return "postgresql+psycopg://" + url.split("://", 1)[1]
    return url


@lru_cache(maxsize=16)
def engine_for(url: str) -> Engine:
    url = normalize_url(url)
    if url.startswith("sqlite"):
        path = make_url(url).database
        if path and path != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)    # a new data directory is fine
        engine = create_engine(url, connect_args={"timeout": 30, "check_same_thread": False})

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(conn, _record):
            cur = conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA busy_timeout=30000")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.execute("PRAGMA synchronous=NORMAL")
            cur.close()
    else:
        engine = create_engine(url, pool_pre_ping=True)
    _ensure_schema(engine)
    return engine


def _ensure_schema(engine: Engine) -> None:
    Base.metadata.create_all(engine)
    with Session(engine) as session:
        rows = session.scalars(select(SchemaVersion.version)).all()
        if not rows:
            session.add(SchemaVersion(version=SCHEMA_VERSION))
            session.commit()
        elif max(rows) != SCHEMA_VERSION:
            raise RuntimeError(
                f"the database at {engine.url.render_as_string(hide_password=True)} has sltune schema version "
                f"{max(rows)}, this sltune uses {SCHEMA_VERSION}; use a matching sltune or a new database"
            )


def sessions(url: str) -> sessionmaker[Session]:
    return sessionmaker(engine_for(url), expire_on_commit=False)


def is_postgres(url: str) -> bool:
    return normalize_url(url).startswith("postgresql")
