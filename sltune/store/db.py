"""Opening a store by URL: SQLite (a file, WAL mode) by default, PostgreSQL to scale out."""

from __future__ import annotations

import fcntl
import json
import logging
import os
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path
from typing import Iterator

logging.getLogger("alembic").setLevel(logging.WARNING)      # not a line per plugin and migration at each start

from alembic import command  # noqa: E402
from alembic.config import Config  # noqa: E402
from alembic.runtime.migration import MigrationContext  # noqa: E402
from alembic.script import ScriptDirectory  # noqa: E402
from sqlalchemy import Connection, Engine, create_engine, event, inspect, make_url, text  # noqa: E402
from sqlalchemy.exc import SQLAlchemyError  # noqa: E402
from sqlalchemy.orm import Session, sessionmaker  # noqa: E402

from sltune.store.faults import unusable  # noqa: E402
from sltune.store.migrations.names import BASELINE, VERSION_TABLE  # noqa: E402

MIGRATIONS = Path(__file__).parent / "migrations"


def normalize_url(url: str) -> str:
    """postgresql:// means psycopg 3 here (the driver sltune installs)."""
    if url.startswith("postgresql://") or url.startswith("postgres://"):
        return "postgresql+psycopg://" + url.split("://", 1)[1]
    return url


def load_json(text: str | bytes) -> object:
    """A JSON column's value, always answerable: strings holding a lone UTF-16 surrogate (stored before POST
    /tune refused them, or by another writer; \\udxxx in the stored text) read back with U+FFFD in its place,
    since no UTF-8 answer could hold them."""
    value = json.loads(text)
    marks = (b"\\ud", b"\\uD") if isinstance(text, bytes) else ("\\ud", "\\uD")
    if marks[0] in text or marks[1] in text:
        from sltune.plaindata import readable

        value = readable(value)
    return value


@lru_cache(maxsize=16)
def engine_for(url: str) -> Engine:
    """The engine of the database at `url`, its schema brought up to date. A database that cannot be opened as
    given (it does not exist, no server answers, the server refuses the user) is the user's to fix: an
    UnusableDatabase saying how, here where every command, the server and the workers open their store, and
    never retried. Failures of a database once open (a restart) pass through sltune.store.faults as before."""
    try:
        return _open(url)
    except SQLAlchemyError as err:
        mistake = unusable(url, err)
        if mistake is None:
            raise
        raise mistake from err


def _open(url: str) -> Engine:
    url = normalize_url(url)
    if url.startswith("sqlite"):
        path = make_url(url).database
        if path and path != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)    # a new data directory is fine
        # a pool no smaller than the API's thread limit (Settings.api_threads, 4 by default) or a worker's
        # threads: a connection opened past the pool is closed after use, and opening one runs the pragmas below
        engine = create_engine(url, connect_args={"timeout": 30, "check_same_thread": False},
                               pool_size=16, max_overflow=16, json_deserializer=load_json)

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(conn, _record):
            cur = conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA busy_timeout=30000")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.execute("PRAGMA synchronous=NORMAL")
            cur.close()
    else:
        engine = create_engine(url, pool_pre_ping=True, json_deserializer=load_json)
    try:
        _ensure_schema(engine)
    except BaseException:
        engine.dispose()            # not cached: no pool left behind for a database that could not be opened
        raise
    return engine


def _ensure_schema(engine: Engine) -> None:
    """Bring the database to the newest migration; a database made by sltune 0.1 (no Alembic) is
    stamped with the baseline first. Processes starting together take turns (a lock), and a database
    newer than this sltune is refused with a clear message."""
    script = ScriptDirectory(str(MIGRATIONS))
    head = script.get_current_head()
    with engine.connect() as conn:
        if _revision(conn) == head:
            return
    with _migration_lock(engine) as conn:
        current = _revision(conn)
        if current == head:
            return
        if current is not None and script.get_revision(current) is None:
            raise RuntimeError(f"{_where(engine)} was migrated by a newer sltune (revision {current}); "
                               "use that sltune or a new database")
        cfg = Config()
        cfg.set_main_option("script_location", str(MIGRATIONS))
        cfg.attributes["connection"] = conn
        if current is None and inspect(conn).has_table("sltune_jobs"):
            old = conn.execute(text("SELECT max(version) FROM sltune_schema_version")).scalar()
            if old != 1:
                raise RuntimeError(f"{_where(engine)} has sltune schema version {old}, which no migration "
                                   "starts from; use a matching sltune or a new database")
            command.stamp(cfg, BASELINE)
        command.upgrade(cfg, "head")


def _revision(conn: Connection) -> str | None:
    return MigrationContext.configure(conn, opts={"version_table": VERSION_TABLE}).get_current_revision()


def _where(engine: Engine) -> str:
    return f"the database at {engine.url.render_as_string(hide_password=True)}"


@contextmanager
def _migration_lock(engine: Engine) -> Iterator[Connection]:
    """One transaction, held alone: an advisory lock on PostgreSQL, a lock file beside a SQLite file."""
    if engine.dialect.name == "postgresql":
        with engine.begin() as conn:
            conn.execute(text("SELECT pg_advisory_xact_lock(hashtext('sltune-migrate'))"))
            yield conn
        return
    path = engine.url.database
    with open(f"{path}.lock" if path and path != ":memory:" else os.devnull, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        with engine.begin() as conn:
            yield conn


def sessions(url: str) -> sessionmaker[Session]:
    return sessionmaker(engine_for(url), expire_on_commit=False)


def is_postgres(url: str) -> bool:
    return normalize_url(url).startswith("postgresql")
