"""A throwaway database on the test PostgreSQL server, created and dropped around the pg_url fixtures
(tests/conftest.py)."""

from __future__ import annotations

import uuid


def fresh_pg_database(server_url: str):
    import sqlalchemy as sa

    from sltune.store.db import normalize_url

    # pre-pinged: a test may restart the server between this database's creation and its drop
    admin = sa.create_engine(normalize_url(server_url), isolation_level="AUTOCOMMIT", pool_pre_ping=True)
    name = f"sltune_t_{uuid.uuid4().hex[:10]}"
    with admin.connect() as c:
        c.execute(sa.text(f'CREATE DATABASE "{name}"'))
    base = server_url.rsplit("/", 1)[0]
    yield f"{base}/{name}"
    from sltune.store.db import engine_for

    engine_for.cache_clear()
    with admin.connect() as c:
        c.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    admin.dispose()
