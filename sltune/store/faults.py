"""When the database fails under a process: which failures pass, and riding them out.

A PostgreSQL restart or failover drops every connection and refuses new ones for a few seconds ("Connection
refused", "the database system is starting up"); a full disk refuses writes until space is freed. Neither is
the job's fault, so workers retry each store call through them, with backoff, for a bounded time
(`Settings.db_retry_s`, by default the lease) and a job fails only for its own reasons. The API does not wait:
it answers 503 (unreachable, retry later) or 507 (the store cannot write) at once.

A database that cannot be opened as given is another matter: one that does not exist, no server at that address,
a user the server refuses, a URL that names no database. No wait mends those; opening the store (sltune.store.db)
raises them as an UnusableDatabase naming the fix, which is never retried.
"""

from __future__ import annotations

import errno
import functools
import logging
import re
import shlex
import time
from typing import Any, Callable, TypeVar

from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError, DBAPIError, InterfaceError, OperationalError

log = logging.getLogger("sltune.store")
T = TypeVar("T")

_FULL_ERRNOS = {errno.ENOSPC, errno.EDQUOT}
_FULL_TEXT = ("database or disk is full", "no space left on device", "disk quota exceeded", "could not extend file",
              "could not write to file")


def _chain(err: BaseException) -> list[BaseException]:
    """err and its causes (Optuna wraps SQLAlchemy's errors, which wrap the driver's)."""
    seen: list[BaseException] = []
    while err is not None and err not in seen and len(seen) < 8:
        seen.append(err)
        err = err.__cause__ or err.__context__ or getattr(err, "orig", None)
    return seen


def is_full(err: BaseException) -> bool:
    """The store (or the disk under it) has no room to write: SQLite's SQLITE_FULL, PostgreSQL's disk_full
    (53100) or an ENOSPC."""
    for e in _chain(err):
        if isinstance(e, OSError) and e.errno in _FULL_ERRNOS:
            return True
        if getattr(e, "sqlstate", None) == "53100":       # PostgreSQL's disk_full
            return True
        if isinstance(e, (DBAPIError, OSError)) or type(e).__module__.startswith(("sqlite3", "psycopg")):
            if any(t in str(e).lower() for t in _FULL_TEXT):
                return True
    return False


def is_unreachable(err: BaseException) -> bool:
    """The database dropped or refused the connection, or cannot serve yet (starting up, shutting down,
    a failover): a retry later may well succeed. Not so for one that could not be opened as given."""
    if is_unusable(err):
        return False
    for e in _chain(err):
        if isinstance(e, DBAPIError) and e.connection_invalidated:
            return True
        if isinstance(e, (OperationalError, InterfaceError)):
            return True
    return False


def is_transient(err: BaseException) -> bool:
    return not is_unusable(err) and (is_full(err) or is_unreachable(err))


_DB_FLAG = "--db/SLTUNE_DB"      # where a command's database URL comes from


class UnusableDatabase(ValueError):
    """The database cannot be opened as given, for a reason the user fixes (the message says how): no retry
    waits for it, and as a ValueError a command says it in one line with exit code 2."""


def is_unusable(err: BaseException) -> bool:
    return any(isinstance(e, UnusableDatabase) for e in _chain(err))


def unusable(url: str, err: BaseException) -> UnusableDatabase | None:
    """err, raised while opening the database at `url` (as the user gave it), as the user's mistake with its fix;
    None when it is none of those (a server starting up, a bug): that error stands as it is."""
    try:
        parsed = make_url(url)
    except ArgumentError:
        return UnusableDatabase(f"{_DB_FLAG} {url}: not a database URL; give sqlite:///FILE for a SQLite file "
                                "(e.g. sqlite:///jobs.db) or postgresql://USER@HOST[:PORT]/DATABASE")
    said = " ".join(" ".join(str(e).split()) for e in _chain(err)
                    if type(e).__module__.startswith(("psycopg", "sqlite3")))
    for pattern, fix in _OPEN_FAILURES:
        found = re.search(pattern, said)
        if found:
            return UnusableDatabase(f"{_DB_FLAG} {parsed.render_as_string(hide_password=True)}: "
                                    f"{fix(found, parsed)}")
    return None


def _pg_options(url: URL) -> list[str]:
    """-h HOST [-p PORT] of the PostgreSQL command-line tools, for the server the URL names."""
    host = url.host or url.query.get("host")
    options = [f"-h {shlex.quote(str(host))}"] if host else []
    return options + [f"-p {url.port}"] if url.port not in (None, 5432) else options


def _createdb(url: URL) -> str:
    user = [f"-U {shlex.quote(url.username)}"] if url.username else []
    return " ".join(["createdb", *_pg_options(url), *user, shlex.quote(url.database or "")])


def _createuser(url: URL, role: str) -> str:
    return " ".join(["createuser", *_pg_options(url), "-U postgres", shlex.quote(role)])


def _server(url: URL) -> str:
    return f"{url.host or url.query.get('host') or 'localhost'} port {url.port or 5432}"


# (pattern in the driver's words, the problem and its fix); the first that matches says it
_OPEN_FAILURES: list[tuple[str, Callable[[re.Match, URL], str]]] = [
    (r'database "([^"]+)" does not exist',
     lambda m, u: f'database "{m[1]}" does not exist; create it with: {_createdb(u)}'),
    (r'role "([^"]+)" does not exist',
     lambda m, u: f'role "{m[1]}" does not exist on the server; put an existing user in the URL '
                  f"(postgresql://USER@HOST/DB), or create it with: {_createuser(u, m[1])}"),
    (r'password authentication failed for user "([^"]+)"',
     lambda m, u: f'password authentication failed for user "{m[1]}"; put the right password in the URL '
                  "(postgresql://USER:PASSWORD@HOST/DB) or in ~/.pgpass"),
    (r"no password supplied",
     lambda m, u: f"the server wants a password for user {u.username or 'the current user'!r}; put it in the URL "
                  "(postgresql://USER:PASSWORD@HOST/DB) or in ~/.pgpass"),
    (r'no pg_hba\.conf entry for host "([^"]+)", user "([^"]+)", database "([^"]+)"',
     lambda m, u: f'the server does not let user "{m[2]}" connect from {m[1]} to database "{m[3]}" (no pg_hba.conf '
                  "entry); allow it in the server's pg_hba.conf, or connect as a user or from a host it allows"),
    (r"failed to resolve host '([^']+)'|could not translate host name \"([^\"]+)\"",
     lambda m, u: f"host '{m[1] or m[2]}' is unknown (its name does not resolve); fix the host in the URL"),
    (r'connection to server on socket "([^"]+)" failed: (No such file or directory|Connection refused)',
     lambda m, u: f"no PostgreSQL server listens on the socket {m[1]}; start it, or give its host in the URL"),
    (r"Connection refused",
     lambda m, u: f"no PostgreSQL server accepts connections at {_server(u)} (connection refused); start it, or "
                  "fix the host and port in the URL"),
    (r"timeout expired",
     lambda m, u: f"no answer from {_server(u)} within the connect timeout; check the host and port in the URL, "
                  "and that no firewall drops the connection"),
    (r"unable to open database file",
     lambda m, u: f"SQLite cannot open {u.database}; give the path of a database file (new or existing) in a "
                  "directory this user can write"),
    (r"file is not a database",
     lambda m, u: f"{u.database} is not a SQLite database; give another file, or the path of a new one"),
]


def describe(err: BaseException) -> str:
    """One line for a log or an answer: the driver's error and its first line, without SQL or parameters."""
    chain = _chain(err)
    driver = next((e.orig for e in chain if isinstance(e, DBAPIError) and e.orig is not None), None)
    shown = driver if driver is not None else err
    text = str(shown).strip().splitlines()
    return f"{type(shown).__name__}: {text[0] if text else ''}".strip()


def retrying(call: Callable[[], T], seconds: float, what: str = "a store call",
             idempotent_after: Callable[[BaseException], bool] | None = None) -> T:
    """call(), retried through transient database failures with backoff (0.1 s doubling to 2 s) for up to
    `seconds`; then the last failure is raised. `idempotent_after(err)` says whether an error raised by a
    retry means the first attempt went through after all (its commit landed but its answer was lost)."""
    deadline = time.monotonic() + seconds
    delay = 0.1
    failed = False
    while True:
        try:
            return call()
        except Exception as err:  # noqa: BLE001 - sorted below
            if failed and idempotent_after is not None and idempotent_after(err):
                return True  # type: ignore[return-value]
            if not is_transient(err) or time.monotonic() + delay > deadline:
                raise
            if not failed:
                log.warning("%s failed (%s); retrying for up to %.0fs", what, describe(err), seconds)
            failed = True
        time.sleep(delay)
        delay = min(delay * 2, 2.0)


def durable(cls: type) -> type:
    """Class decorator: every public method retried as `retrying` does, for the instance's `retry_s`
    seconds (0: no retries)."""
    for name, fn in list(vars(cls).items()):
        if name.startswith("_") or not callable(fn) or isinstance(fn, (staticmethod, classmethod, type)):
            continue
        setattr(cls, name, _retried(fn))
    return cls


def _retried(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def call(self, *args: Any, **kwargs: Any) -> Any:
        if not self.retry_s:
            return fn(self, *args, **kwargs)
        return retrying(lambda: fn(self, *args, **kwargs), self.retry_s, f"{type(self).__name__}.{fn.__name__}")
    return call


_DURABLE_RDB: type | None = None


def durable_rdb_storage(url: str, engine_kwargs: dict[str, Any]) -> Any:
    """Optuna's RDB storage whose every call is retried through transient database failures for the storage's
    `retry_s` seconds (0, its default: none). A finished trial's state written again by a retry (the first write
    landed, its answer was lost) is no error. (Optuna is imported here, not by every user of the store.)"""
    global _DURABLE_RDB
    if _DURABLE_RDB is None:
        import optuna

        def retried(fn: Callable[..., Any]) -> Callable[..., Any]:
            @functools.wraps(fn)
            def call(self, *args: Any, **kwargs: Any) -> Any:
                if not self.retry_s:
                    return fn(self, *args, **kwargs)
                return retrying(lambda: fn(self, *args, **kwargs), self.retry_s, f"optuna {fn.__name__}",
                                idempotent_after=lambda e: isinstance(e, optuna.exceptions.UpdateFinishedTrialError))
            return call

        methods = {name: retried(getattr(optuna.storages.RDBStorage, name))
                   for name in dir(optuna.storages.BaseStorage)
                   if not name.startswith("_") and name != "remove_session"
                   and callable(getattr(optuna.storages.RDBStorage, name, None))}
        _DURABLE_RDB = type("DurableRDBStorage", (optuna.storages.RDBStorage,),
                            {"retry_s": 0.0, "__module__": __name__, **methods})
    return _DURABLE_RDB(url, engine_kwargs=engine_kwargs)
