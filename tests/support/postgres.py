"""A throwaway database on the test PostgreSQL server, created and dropped around the pg_url fixtures
(tests/conftest.py), and a private PostgreSQL server for the test that restarts one: restarting the shared server
broke whichever PostgreSQL test ran beside it on the other xdist worker ("connection refused", CI of stop 54)."""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator


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


class PrivatePostgres:
    """A PostgreSQL server of this test's own: a cluster made by initdb in a temporary folder, on a free
    loopback port, trust auth, run as the postgres user when the tests run as root (initdb refuses root)."""

    def __init__(self, bindir: str, folder: str, port: int, user: list[str]):
        self.bindir, self.folder, self.port, self.user = bindir, folder, port, user
        self.url = f"postgresql://postgres@127.0.0.1:{port}/postgres"

    def ctl(self, *args: str) -> None:
        options = f"-p {self.port} -c listen_addresses=127.0.0.1 -c unix_socket_directories=''"
        subprocess.run([*self.user, f"{self.bindir}/pg_ctl", "-D", f"{self.folder}/data", "-l",
                        f"{self.folder}/log", "-o", options, "-w", "-t", "60", *args],
                       check=True, capture_output=True, timeout=90)

    def restart(self, down_s: float) -> float:
        """Stop fast, stay down for down_s, start; the seconds until it accepts connections again (pg_ctl -w waits
        for that, and fails after its -t)."""
        t0 = time.monotonic()
        try:
            self.ctl("-m", "fast", "stop")
            time.sleep(down_s)
        finally:
            self.ctl("start")
        return time.monotonic() - t0


def postgres_bindir() -> str | None:
    """Where initdb and pg_ctl are: pg_config's answer, else Debian's versioned folder."""
    if shutil.which("pg_config"):
        bindir = subprocess.run(["pg_config", "--bindir"], capture_output=True, text=True).stdout.strip()
        if os.path.exists(f"{bindir}/initdb"):
            return bindir
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    return os.path.dirname(found[-1]) if found else None


@contextlib.contextmanager
def private_postgres() -> Iterator[PrivatePostgres]:
    """Yield a running private server, stopped and deleted afterwards; skip, saying why, where none can run."""
    import pytest

    bindir = postgres_bindir()
    if bindir is None:
        pytest.skip("no PostgreSQL server binaries (initdb, pg_ctl) to run a private server with")
    user: list[str] = []
    folder = tempfile.mkdtemp(prefix="sltune-pg-")
    if os.geteuid() == 0:
        if shutil.which("runuser") is None:
            pytest.skip("running as root without runuser: initdb refuses root")
        user = ["runuser", "-u", "postgres", "--"]
        shutil.chown(folder, "postgres")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = PrivatePostgres(bindir, folder, port, user)
    try:
        subprocess.run([*user, f"{bindir}/initdb", "-D", f"{folder}/data", "-U", "postgres", "--auth=trust",
                        "--no-sync", "-E", "UTF8"], check=True, capture_output=True, timeout=120)
        server.ctl("start")
        yield server
    finally:
        with contextlib.suppress(subprocess.SubprocessError):
            server.ctl("-m", "immediate", "stop")
        shutil.rmtree(folder, ignore_errors=True)
